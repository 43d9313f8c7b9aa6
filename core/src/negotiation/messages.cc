// Requests and responses on the wire: one field list per message kind, read and written
// by the same template, so the two directions cannot drift apart.
#include "negotiation/coordinator.h"
#include "negotiation/wire.h"

namespace shoal {

namespace {

template <typename IO, typename... T> void Fields(IO& io, T&... v) { (io.Field(v), ...); }

// The fields of a request and of a response, in wire order, for both directions.
template <typename IO, typename R> void RequestFields(IO& io, R& r) {
  Fields(io, r.set, r.name, r.sig, r.step, r.reject, r.reject_code, r.topo_check);
  if (r.topo_check) Fields(io, r.send, r.recv, r.known);
  io.Field(r.probe);
  if (r.sig.op == SHOAL_OP_ALLTOALL) io.Field(r.splits);
  if (r.sig.op & SHOAL_GROUPED) io.Field(r.members);
  io.Field(r.retire);
  if (!r.retire.empty()) io.Field(r.retire_calls);
}

template <typename IO, typename R> void ResponseFields(IO& io, R& r) {
  Fields(io, r.kind, r.set, r.op, r.names, r.error, r.step, r.code, r.first_dims, r.channel, r.joined);
  if (!r.joined.empty()) io.Field(r.sigs);
  if (r.op & SHOAL_GROUPED) io.Field(r.chunks);
  if (r.op == SHOAL_OP_NEIGHBOR_ALLREDUCE || r.op == SHOAL_OP_NEIGHBOR_ALLGATHER) io.Field(r.trusted);
  io.Field(r.retired);
}

}  // namespace

namespace {

// A count, then each item's fields (RequestFields or ResponseFields).
template <typename T> ByteVec Encode(const std::vector<T>& items, void (*fields)(Writer&, const T&)) {
  Writer w;
  w.Put<uint32_t>(static_cast<uint32_t>(items.size()));
  for (auto& x : items) fields(w, x);
  return std::move(w.buffer());
}

template <typename T> std::vector<T> Decode(const char* p, size_t n, void (*fields)(Reader&, T&)) {
  Reader r(p, n);
  std::vector<T> out(r.Get<uint32_t>());
  for (auto& x : out) fields(r, x);
  return out;
}

}  // namespace

ByteVec EncodeRequests(const std::vector<Request>& reqs) {
  return Encode<Request>(reqs, RequestFields<Writer, const Request>);
}
std::vector<Request> DecodeRequests(const char* p, size_t n) { return Decode<Request>(p, n, RequestFields<Reader, Request>); }
ByteVec EncodeResponses(const std::vector<Response>& resps) {
  return Encode<Response>(resps, ResponseFields<Writer, const Response>);
}
std::vector<Response> DecodeResponses(const char* p, size_t n) {
  return Decode<Response>(p, n, ResponseFields<Reader, Response>);
}

}  // namespace shoal

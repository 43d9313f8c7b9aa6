// Byte-level encoding of control and data-message headers (host byte order: all
// ranks of one job share an architecture).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/common.h"

namespace shoal {

class Writer {
 public:
  explicit Writer(size_t reserve = 0) { buf_.reserve(reserve); }
  template <typename T> void Put(const T& v) {
    const char* p = reinterpret_cast<const char*>(&v);
    buf_.insert(buf_.end(), p, p + sizeof(T));
  }
  void PutString(const std::string& s) {
    Put<uint32_t>(static_cast<uint32_t>(s.size()));
    buf_.insert(buf_.end(), s.begin(), s.end());
  }
  void PutRanks(const std::vector<int>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    for (auto x : v) Put<int32_t>(x);
  }
  void PutShape(const std::vector<int64_t>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    for (auto x : v) Put<int64_t>(x);
  }
  void PutSignature(const Signature& s) {
    Put(s.op); Put(s.dtype); Put(s.device_type); Put(s.reduce_op); Put(s.root_rank); Put(s.scope); Put(s.path);
    PutShape(s.shape);
  }
  void PutBytes(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    buf_.insert(buf_.end(), c, c + n);
  }
  // One field of a message whose fields a single function lists for both directions
  // (Reader::Field reads the same layout back). bool travels as int32.
  void Field(bool v) { Put<int32_t>(v); }
  void Field(int32_t v) { Put(v); }
  void Field(int64_t v) { Put(v); }
  void Field(const std::string& s) { PutString(s); }
  void Field(const std::vector<int>& v) { PutRanks(v); }
  void Field(const std::vector<int64_t>& v) { PutShape(v); }
  void Field(const Signature& s) { PutSignature(s); }
  template <typename T> void Field(const std::vector<T>& v) {
    Put<uint32_t>(static_cast<uint32_t>(v.size()));
    for (auto& x : v) Field(x);
  }
  ByteVec& buffer() { return buf_; }
  size_t size() const { return buf_.size(); }

 private:
  ByteVec buf_;
};

class Reader {
 public:
  Reader(const char* p, size_t n) : p_(p), end_(p + n) {}
  template <typename T> T Get() {
    Need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string GetString() {
    uint32_t n = Get<uint32_t>();
    Need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  std::vector<int> GetRanks() {
    std::vector<int> v(Get<uint32_t>());
    for (auto& x : v) x = Get<int32_t>();
    return v;
  }
  std::vector<int64_t> GetShape() {
    uint32_t n = Get<uint32_t>();
    std::vector<int64_t> v(n);
    for (auto& x : v) x = Get<int64_t>();
    return v;
  }
  Signature GetSignature() {
    Signature s;
    s.op = Get<int32_t>(); s.dtype = Get<int32_t>(); s.device_type = Get<int32_t>();
    s.reduce_op = Get<int32_t>(); s.root_rank = Get<int32_t>(); s.scope = Get<int32_t>(); s.path = Get<int32_t>();
    s.shape = GetShape();
    return s;
  }
  void Field(bool& v) { v = Get<int32_t>() != 0; }
  void Field(int32_t& v) { v = Get<int32_t>(); }
  void Field(int64_t& v) { v = Get<int64_t>(); }
  void Field(std::string& s) { s = GetString(); }
  void Field(std::vector<int>& v) { v = GetRanks(); }
  void Field(std::vector<int64_t>& v) { v = GetShape(); }
  void Field(Signature& s) { s = GetSignature(); }
  template <typename T> void Field(std::vector<T>& v) {
    v.resize(Get<uint32_t>());
    for (auto& x : v) Field(x);
  }
  const char* Skip(size_t n) {
    Need(n);
    const char* at = p_;
    p_ += n;
    return at;
  }
  bool done() const { return p_ >= end_; }

 private:
  void Need(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) throw std::runtime_error("truncated Shoal message");
  }
  const char* p_;
  const char* end_;
};

// The coordinator's messages (negotiation/coordinator.h): requests and responses on the wire.
namespace wire {

template <typename IO, typename... T> void Fields(IO& io, T&... v) { (io.Field(v), ...); }

// The fields of a request and of a response, in wire order, for both directions.
template <typename IO, typename R> void RequestFields(IO& io, R& r) {
  Fields(io, r.set, r.name, r.sig, r.step, r.reject, r.reject_code, r.topo_check);
  if (r.topo_check) Fields(io, r.send, r.recv);
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
  io.Field(r.retired);
}

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

}  // namespace wire

}  // namespace shoal

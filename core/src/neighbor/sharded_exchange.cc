#include "neighbor/sharded_exchange.h"

#include <algorithm>
#include <cstring>

#include "common/reduce.h"

namespace shoal {

struct ShardedRun {
  enum Role { kScatterSend, kScatterSum, kExchange, kGatherSend, kGatherReceive };
  struct Slot {
    EntryPtr e;
    Role role;
    int next = -1;  // the part that starts when this one ends
    bool started = false, ended = false;
  };
  EntryPtr stage;
  std::vector<Slot> parts;
  int left = 0;  // parts not ended
};

EntryPtr ShardedExchange::Part(const std::shared_ptr<ShardedRun>& run, const std::string& suffix, int64_t offset,
                               int64_t count) {
  const Entry& s = *run->stage;
  auto p = std::make_shared<Entry>();
  p->name = s.name + suffix;
  p->sig = s.sig;  // the whole tensor's shape: peers holding another fail on it
  p->span = count;
  p->step = s.step;
  const size_t at = static_cast<size_t>(offset) * DtypeSize(s.sig.dtype);
  p->input = p->output = s.output;
  p->output.data = static_cast<char*>(s.output.data) + at;
  p->input.data = p->output.data;
  p->sharded = run;  // until the run ends (ShardedRun::parts holds the parts)
  p->part = static_cast<int>(run->parts.size());
  run->parts.push_back({p, ShardedRun::kScatterSend});
  ++run->left;
  return p;
}

bool ShardedExchange::Start(const EntryPtr& e, std::vector<EntryPtr>* start) {
  const int L = world_.local_size, me = world_.local_rank;
  const int64_t n = e->count();
  if (n == 0) return false;
  auto run = std::make_shared<ShardedRun>();
  run->stage = e;
  e->t_comm_start = Clock::now();  // the timeline's WAIT_FOR_PEERS: the whole run
  // Shard s: n / L elements, one more for the first n % L; each in K pieces (K the same
  // for every shard, so every rank of the machine cuts them alike).
  auto shard_at = [&](int s) { return s * (n / L) + std::min<int64_t>(s, n % L); };
  auto shard_size = [&](int s) { return n / L + (s < n % L ? 1 : 0); };
  const int64_t biggest = static_cast<int64_t>(shard_size(0) * DtypeSize(e->sig.dtype));
  const int K = static_cast<int>(std::clamp<int64_t>((biggest + kPieceBytes - 1) / kPieceBytes, 1, kMaxPieces));
  const char* in = static_cast<const char*>(e->input.data);
  const size_t dsize = DtypeSize(e->sig.dtype);
  std::vector<int> others;  // the machine's other ranks, by local rank
  for (int s = 0; s < L; ++s) if (s != me) others.push_back(world_.machine_ranks[s]);
  std::vector<int> first;  // the parts that start now
  for (int k = 0; k < K; ++k) {
    for (int s = 0; s < L; ++s) {
      const int64_t lo = shard_at(s) + shard_size(s) * k / K, hi = shard_at(s) + shard_size(s) * (k + 1) / K;
      if (hi == lo) continue;
      const std::string piece = std::to_string(k) + "." + std::to_string(s);
      if (s == me) {
        // The machine's sum of the piece, then its exchange, then its way to the others.
        EntryPtr sum = Part(run, "/s" + piece, lo, hi - lo);
        sum->input.data = const_cast<char*>(in) + lo * dsize;
        sum->recv_ranks = others;
        sum->recv_weights.assign(others.size(), 1.0);
        sum->uniform = false;
        EntryPtr x = Part(run, "/x" + std::to_string(k), lo, hi - lo);
        x->recv_ranks = e->recv_ranks;
        x->recv_weights = e->recv_weights;
        x->send_ranks = e->send_ranks;
        x->send_weights = e->send_weights;
        x->self_weight = e->self_weight;
        x->uniform = e->uniform;
        run->parts[sum->part].role = ShardedRun::kScatterSum;
        run->parts[x->part].role = ShardedRun::kExchange;
        run->parts[sum->part].next = x->part;
        if (!others.empty()) {
          EntryPtr g = Part(run, "/g" + piece, lo, hi - lo);
          g->send_ranks = others;
          run->parts[g->part].role = ShardedRun::kGatherSend;
          run->parts[x->part].next = g->part;
        }
        first.push_back(sum->part);
      } else {
        // Rank s's piece of this rank's input goes to it; its result comes back once that
        // send is done (output and input may be one tensor).
        EntryPtr send = Part(run, "/s" + piece, lo, hi - lo);
        send->input.data = send->output.data = const_cast<char*>(in) + lo * dsize;
        send->send_ranks = {world_.machine_ranks[s]};
        EntryPtr back = Part(run, "/g" + piece, lo, hi - lo);
        back->recv_ranks = {world_.machine_ranks[s]};
        back->recv_weights = {1.0};
        back->uniform = false;
        run->parts[back->part].role = ShardedRun::kGatherReceive;
        run->parts[send->part].next = back->part;
        first.push_back(send->part);
      }
    }
  }
  runs_[{e->name, e->step}] = run;
  for (int i : first) Launch(*run, i, start);
  return true;
}

void ShardedExchange::Launch(ShardedRun& run, int part, std::vector<EntryPtr>* start) {
  ShardedRun::Slot& slot = run.parts[part];
  slot.started = true;
  // Received into zeros with weight 1: the result, exactly.
  if (slot.role == ShardedRun::kGatherReceive) std::memset(slot.e->output.data, 0, slot.e->nbytes());
  start->push_back(slot.e);
}

EntryPtr ShardedExchange::Stop(std::shared_ptr<ShardedRun> run, int failed) {  // a copy: runs_ holds the original
  for (size_t i = 0; i < run->parts.size() && (run->left > 0 || failed >= 0); ++i) {  // else every part took its pieces
    const ShardedRun::Slot& slot = run->parts[i];
    if (slot.started && !slot.ended) neighbors_->Drop(slot.e);
    // Pieces peers sent or still send for this step are not data for the name's next step.
    if ((!slot.ended || static_cast<int>(i) == failed) && !slot.e->recv_ranks.empty())
      neighbors_->Failed(slot.e->name, slot.e->step);
  }
  EntryPtr stage = run->stage;
  runs_.erase({stage->name, stage->step});
  run->parts.clear();  // the parts held the run
  return stage;
}

EntryPtr ShardedExchange::Done(const EntryPtr& p, const Status& st, std::vector<EntryPtr>* start, Status* stage_st) {
  std::shared_ptr<ShardedRun> run = p->sharded;
  if (!run || p->part < 0 || run->parts.empty()) return nullptr;  // its run was taken or ended
  ShardedRun::Slot& slot = run->parts[p->part];
  if (slot.ended) return nullptr;
  slot.ended = true;
  --run->left;
  if (!st.ok()) {  // the run stops here; the scheduler tells every rank of this step
    *stage_st = st;
    return Stop(run, p->part);
  }
  if (slot.role == ShardedRun::kExchange && world_.local_size > 1)  // BlueFog's average over the machine
    Divide(p->output.data, p->output.data, p->sig.dtype, p->count(), world_.local_size);
  if (slot.next >= 0) Launch(*run, slot.next, start);
  if (run->left > 0) return nullptr;
  run->stage->t_peers_ready = Clock::now();
  *stage_st = Status::Ok();
  return Stop(run);
}

const Entry* ShardedExchange::StageOf(const std::string& part, int64_t step) const {
  const size_t slash = part.rfind('/');
  if (slash == std::string::npos) return nullptr;
  auto it = runs_.find({part.substr(0, slash), step});
  return it == runs_.end() ? nullptr : it->second->stage.get();
}

EntryPtr ShardedExchange::Take(const std::string& name, int64_t step) {
  auto it = runs_.find({name, step});
  return it == runs_.end() ? nullptr : Stop(it->second);
}

void ShardedExchange::Clear() {
  for (auto& [key, run] : runs_) run->parts.clear();
  runs_.clear();
}

}  // namespace shoal

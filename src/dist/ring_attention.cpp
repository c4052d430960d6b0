// Ring attention over MPI (include/qkv/dist.hpp): the sequence is split across the ranks of a
// communicator, K/V blocks travel around the ring, and each rank merges the partial results of
// its queries through their lse. Each (query chunk, key chunk) pair is one call of
// scaled_dot_product_attention or its backward, through src/attention/ring_block.hpp, which differs only
// in ALiBi's distances (those of the whole sequence), with the global mask shifted to the pair's
// positions and the tensor terms' view of the pair; any kernel behind it serves the distributed call
// unchanged. Softcap acts per score and needs nothing more. Sinks join each row's softmax once,
// after the ring (merge_sinks); their gradient needs only the rows' O, dO and lse.
//
// Layout inside a call. The caller's shard on rank r is the contiguous rows r*n ... (r+1)*n - 1
// (n = N/P). Without a causal band each rank computes on that shard as it is: one chunk. With a
// causal band (band_lo unbounded, band_hi finite) and n even, the sequence is cut into 2P chunks
// of c = n/2 rows and rank r computes on chunks r and 2P-1-r (zigzag), so every rank has about
// the same number of visible (query, key) pairs; the chunks are exchanged point to point on
// entry and the results sent back on exit, so the caller still sees contiguous shards.
//
// Forward, step s = 0 .. P-1: rank r holds the K/V chunks of rank (r - s) mod P. It posts the
// receive of the next block from r-1 and the send of the current one to r+1, computes every
// visible (query chunk, key chunk) pair, merges (output, lse) into its accumulators, then waits.
// Backward: the same ring for K/V; the dK/dV accumulator of a block travels one step behind it:
// rank r computes its contribution into a fresh buffer while the accumulator from r-1 is in
// flight, adds it, and sends it on; after P steps each block's accumulator reaches its owner.
#include "qkv/dist.hpp"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "attention/lse_merge.hpp"
#include "attention/ring_block.hpp"
#include "attention/problem.hpp"

namespace qkv::dist {
namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr int kTagKv = 1;      // a K/V block going round the ring
constexpr int kTagGrad = 2;    // a dK/dV accumulator going round the ring
constexpr int kTagZigzag = 16; // + 2 * tensor index + slot: the zigzag exchange on entry and exit

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Throws qkv::Error when an MPI call fails (MPI_ERRORS_RETURN is set on the duplicated comm).
void check_mpi(int code, const char* what) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  throw Error(std::string("ring_attention: ") + what + " failed: " + std::string(text, static_cast<size_t>(len)));
}

// A private duplicate of the caller's communicator, so our tags never meet the caller's messages.
class Comm {
 public:
  explicit Comm(MPI_Comm parent) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) throw Error("ring_attention: MPI is not initialised (call MPI_Init first)");
    if (parent == MPI_COMM_NULL) throw Error("ring_attention: the communicator is MPI_COMM_NULL");
    check_mpi(MPI_Comm_dup(parent, &comm_), "MPI_Comm_dup");
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  ~Comm() { MPI_Comm_free(&comm_); }
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;
  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
};

// Outstanding requests; the destructor waits for them, so an exception thrown between a post and
// its wait (every rank throws at the same step: shapes were checked collectively) leaves no
// message pending and no buffer freed under MPI.
class Requests {
 public:
  ~Requests() { if (!list_.empty()) MPI_Waitall(static_cast<int>(list_.size()), list_.data(), MPI_STATUSES_IGNORE); }
  void send(const float* data, int64_t count, int dest, int tag, MPI_Comm comm, RingStats& stats) {
    list_.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Isend(data, to_int(count), MPI_FLOAT, dest, tag, comm, &list_.back()), "MPI_Isend");
    stats.bytes_sent += count * static_cast<int64_t>(sizeof(float));
  }
  void recv(float* data, int64_t count, int source, int tag, MPI_Comm comm) {
    list_.push_back(MPI_REQUEST_NULL);
    check_mpi(MPI_Irecv(data, to_int(count), MPI_FLOAT, source, tag, comm, &list_.back()), "MPI_Irecv");
  }
  // Lets MPI progress the transfers between two kernel calls (no waiting).
  void poke() {
    if (list_.empty()) return;
    int done = 0;
    MPI_Testall(static_cast<int>(list_.size()), list_.data(), &done, MPI_STATUSES_IGNORE);
  }
  void wait(RingStats& stats) {
    if (list_.empty()) return;
    const auto start = Clock::now();
    const int code = MPI_Waitall(static_cast<int>(list_.size()), list_.data(), MPI_STATUSES_IGNORE);
    list_.clear();
    stats.wait_seconds += seconds_since(start);
    check_mpi(code, "MPI_Waitall");
  }

 private:
  static int to_int(int64_t count) {
    if (count > INT_MAX)
      throw Error("ring_attention: a message of " + std::to_string(count) +
                  " floats exceeds MPI's int count; use more ranks or smaller batches");
    return static_cast<int>(count);
  }
  std::vector<MPI_Request> list_;
};

// ---- shapes -----------------------------------------------------------------------------------

// t as (B, H, n, D): rank 4 as it is, rank 3 (B, n, D) and rank 2 (n, D) with heads of 1.
Tensor as4(const Tensor& t) {
  if (t.dim() == 4) return t.contiguous();
  if (t.dim() == 3) return t.contiguous().unsqueeze(1);
  return t.contiguous().unsqueeze(0).unsqueeze(0);
}

// Copies rows [start, start + len) of dim 2 of a contiguous (A, C, rows, D) tensor into `out`,
// a contiguous (A, C, len, D) tensor (or the reverse when to_rows is true).
void copy_rows(const Tensor& rows, int64_t start, const Tensor& chunk, bool to_rows) {
  const int64_t outer = rows.size(0) * rows.size(1), n = rows.size(2), d = rows.size(3);
  const int64_t len = chunk.size(2);
  float* big = rows.data();
  float* small = chunk.data();
  for (int64_t o = 0; o < outer; ++o) {
    float* a = big + (o * n + start) * d;
    float* b = small + o * len * d;
    if (to_rows) std::memcpy(a, b, sizeof(float) * static_cast<size_t>(len * d));
    else std::memcpy(b, a, sizeof(float) * static_cast<size_t>(len * d));
  }
}

// Buffers kept per thread between calls (ring buffers, accumulators, the pair results), so a loop
// of calls pays for fresh pages once: on this machine's VM a page fault costs as much as the
// kernel's work on a 1024-row shard. Never handed to the caller; release_ring_workspaces() frees them.
struct Workspace {
  std::vector<Tensor> buffers;
  AttentionResult pair;  // scaled_dot_product_attention_into's result, reused pair after pair
  // The buffer in `slot`, shaped `shape`, contents unspecified.
  Tensor get(size_t slot, const Shape& shape) {
    if (slot >= buffers.size()) buffers.resize(slot + 1);
    if (!buffers[slot].defined() || buffers[slot].shape() != shape) buffers[slot] = Tensor::empty(shape);
    return buffers[slot];
  }
};
thread_local Workspace workspace;

// Workspace slot `slot` shaped as t4 with `rows` rows.
Tensor with_rows(const Tensor& t4, int64_t rows, size_t slot) {
  return workspace.get(slot, Shape{t4.size(0), t4.size(1), rows, t4.size(3)});
}

// Which rows of the global sequence each rank computes on (see the file comment).
struct Layout {
  int ranks = 1, rank = 0;
  int64_t n = 0;        // rows per caller shard
  bool zigzag = false;
  int64_t chunk = 0;    // rows per chunk: n, or n / 2 with zigzag
  int chunks = 1;       // per rank: 1, or 2 with zigzag
  // Global first row of chunk `slot` computed by rank `r`.
  int64_t start(int r, int slot) const {
    if (!zigzag) return int64_t{r} * n;
    return (slot == 0 ? int64_t{r} : int64_t{2} * ranks - 1 - r) * chunk;
  }
};

// The zigzag exchange on entry: this rank's contiguous (B, H, n, D) shard becomes its two chunks.
// Global chunk g (rows g*c ...) lies in caller shard g / 2 (half g % 2) and is computed by rank
// g (slot 0) when g < P, else by rank 2P-1-g (slot 1). `index` keeps the tags of tensors apart.
std::vector<Tensor> scatter_chunks(const Tensor& shard, const Layout& layout, const Comm& comm, int index,
                                   Requests& requests, RingStats& stats) {
  // Workspace: 2 chunks, 2 outgoing halves per index, after gather_chunks' slots 40 ... 49.
  const size_t slots = 64 + 4 * static_cast<size_t>(index);
  std::vector<Tensor> chunks;
  if (!layout.zigzag) {
    chunks.push_back(shard);
    return chunks;
  }
  const int p = layout.ranks, r = layout.rank;
  for (int slot = 0; slot < 2; ++slot) {
    chunks.push_back(with_rows(shard, layout.chunk, slots + static_cast<size_t>(slot)));
    const int64_t g = slot == 0 ? r : 2 * p - 1 - r;
    requests.recv(chunks.back().data(), chunks.back().numel(), static_cast<int>(g / 2), kTagZigzag + 2 * index + slot,
                  comm.get());
  }
  for (int half = 0; half < 2; ++half) {
    const int64_t g = 2 * int64_t{r} + half;
    const int dest = static_cast<int>(g < p ? g : 2 * p - 1 - g);
    const int slot = g < p ? 0 : 1;
    const Tensor outgoing = with_rows(shard, layout.chunk, slots + 2 + static_cast<size_t>(half));
    copy_rows(shard, half * layout.chunk, outgoing, false);
    requests.send(outgoing.data(), outgoing.numel(), dest, kTagZigzag + 2 * index + slot, comm.get(), stats);
  }
  return chunks;
}

// The zigzag exchange on exit: this rank's chunks (in slot order) go back to the ranks whose
// contiguous shards hold them; `shard` (B, H, n, D) receives this rank's rows.
void gather_chunks(const std::vector<Tensor>& chunks, const Tensor& shard, const Layout& layout, const Comm& comm,
                   int index, RingStats& stats) {
  if (!layout.zigzag) {
    copy_rows(shard, 0, chunks[0], true);
    return;
  }
  const int p = layout.ranks, r = layout.rank;
  std::vector<Tensor> incoming;
  Requests requests;
  for (int half = 0; half < 2; ++half) {
    incoming.push_back(with_rows(shard, layout.chunk, 40 + 2 * static_cast<size_t>(index) + static_cast<size_t>(half)));
    const int64_t g = 2 * int64_t{r} + half;
    const int source = static_cast<int>(g < p ? g : 2 * p - 1 - g);
    requests.recv(incoming.back().data(), incoming.back().numel(), source, kTagZigzag + 2 * index + half, comm.get());
  }
  for (int slot = 0; slot < 2; ++slot) {
    const int64_t g = slot == 0 ? r : 2 * p - 1 - r;
    requests.send(chunks[static_cast<size_t>(slot)].data(), chunks[static_cast<size_t>(slot)].numel(),
                  static_cast<int>(g / 2), kTagZigzag + 2 * index + static_cast<int>(g % 2), comm.get(), stats);
  }
  requests.wait(stats);
  for (int half = 0; half < 2; ++half) copy_rows(shard, half * layout.chunk, incoming[static_cast<size_t>(half)], true);
}

// ---- masks ------------------------------------------------------------------------------------

// The caller's mask for the pair (query chunk at global row qs, key chunk at global row ks, lq
// and lk rows), in the chunks' local positions. Returns false when no key of the chunk is
// visible to any query of it (the pair is skipped).
bool pair_mask(const Mask& global, int64_t qs, int64_t lq, int64_t ks, int64_t lk, Mask& out) {
  out = Mask();
  if (global.has_band()) {
    // Global: qs + i + lo <= ks + j <= qs + i + hi, so locally i + (lo + qs - ks) <= j <= ...
    const bool lo_open = global.band_lo() <= -Mask::kUnbounded;
    const bool hi_open = global.band_hi() >= Mask::kUnbounded;
    int64_t lo = lo_open ? -lq : global.band_lo() + qs - ks;
    int64_t hi = hi_open ? lk : global.band_hi() + qs - ks;
    if (hi < -(lq - 1) || lo > lk - 1 || lo > hi) return false;
    lo = std::max(lo, -lq);  // every query already sees key 0 on this side: no constraint
    hi = std::min(hi, lk);   // every query already sees key lk - 1
    if (lo == -lq && hi == lk) {
      // the band hides nothing of this pair
    } else if (lo == -lq) {
      out = Mask::causal(hi);
    } else {
      out = Mask::window(hi - lo, 0, hi);
    }
  }
  if (global.has_key_lengths()) {
    std::vector<int64_t> lengths;
    bool any = false;
    for (int64_t length : global.lengths()) {
      lengths.push_back(std::clamp<int64_t>(length - ks, 0, lk));
      any = any || lengths.back() > 0;
    }
    if (!any) return false;
    out &= Mask::key_lengths(std::move(lengths));
  }
  return true;
}

// The caller's tensor terms per query chunk, as (Bm, Hm, rows or 1, N or 1): a term with a row
// per query travels with the queries in the zigzag exchange (tensor index `first_index` on), one
// that broadcasts over the queries serves every chunk as it is.
struct Terms {
  struct Term {
    std::vector<Tensor> chunks;
    bool additive = false;
  };
  std::vector<Term> list;
  int64_t total = 0;  // N, the global number of keys
};

Terms scatter_terms(const Mask& mask, const Layout& layout, const Comm& comm, int first_index, Requests& requests,
                    RingStats& stats) {
  Terms terms;
  terms.total = layout.n * layout.ranks;
  int index = first_index;
  for (const Mask::Term& term : mask.terms()) {
    const Tensor t4 = as4(term.values);
    Terms::Term t;
    t.additive = term.additive;
    if (layout.zigzag && t4.size(2) == layout.n) {
      t.chunks = scatter_chunks(t4, layout, comm, index++, requests, stats);
    } else {
      t.chunks.assign(static_cast<size_t>(layout.chunks), t4);
    }
    terms.list.push_back(std::move(t));
  }
  return terms;
}

// Adds the terms' part for query chunk `qc` and the lk keys from global row ks (views, no copy).
void add_pair_terms(const Terms& terms, int qc, int64_t ks, int64_t lk, Mask& out) {
  for (const Terms::Term& t : terms.list) {
    Tensor c = t.chunks[static_cast<size_t>(qc)];
    if (c.size(3) == terms.total) c = c.narrow(3, ks, lk);
    out &= t.additive ? Mask::additive(c) : Mask::keep(c);
  }
}

// ---- the collective check -------------------------------------------------------------------

// What every rank must agree on, gathered from all ranks before any ring traffic.
struct Descriptor {
  int32_t ok = 1;             // 0: this rank found a problem, described in `message`
  int32_t ranks[5] = {};      // tensor ranks of q, k, v, grad_output / output, lse
  int64_t dims[5][4] = {};
  int64_t band_lo = 0, band_hi = 0;
  uint64_t lengths_hash = 0;
  int32_t has_lengths = 0, backend = 0;
  float scale = 0;
  int32_t has_scale = 0;
  float softcap = 0;
  uint64_t modifiers_hash = 0;  // alibi_slopes and sinks: defined or not, and their bits
  uint64_t terms_hash = 0;      // the tensor terms: how many, their kind and (B, H, Nq, Nk) sizes
  char message[400] = {};
};

// FNV-1a, to compare what every rank must agree on in one number.
struct Hash {
  uint64_t value = 1469598103934665603ull;
  void add(uint64_t x) { value = (value ^ x) * 1099511628211ull; }
  void add(const Tensor& t) {
    add(t.defined() ? static_cast<uint64_t>(t.numel()) + 1 : 0);
    if (!t.defined()) return;
    for (float x : t.to_vector()) {
      uint32_t bits = 0;
      std::memcpy(&bits, &x, sizeof bits);
      add(bits);
    }
  }
};

// A tensor term's sizes aligned to the scores (B, H, Nq, Nk), as scaled_dot_product_attention
// broadcasts it: 2-D is (Nq, Nk), 3-D (B, Nq, Nk), 4-D (B, H, Nq, Nk); absent dims are 1.
std::vector<int64_t> term_sizes(const Tensor& values) {
  static constexpr int kPlace[5][4] = {{}, {}, {2, 3}, {0, 2, 3}, {0, 1, 2, 3}};
  std::vector<int64_t> sizes{1, 1, 1, 1};
  const int64_t rank = values.dim();
  if (rank < 2 || rank > 4) return {};
  for (int64_t d = 0; d < rank; ++d) sizes[static_cast<size_t>(kPlace[rank][d])] = values.size(d);
  return sizes;
}

std::string dims_str(const Descriptor& d, int i) {
  std::vector<int64_t> dims(d.dims[i], d.dims[i] + d.ranks[i]);
  return Shape(std::move(dims)).str();
}

void fill_shape(Descriptor& d, int i, const Tensor& t) {
  if (!t.defined()) return;
  d.ranks[i] = static_cast<int32_t>(std::min<int64_t>(t.dim(), 4));
  for (int a = 0; a < d.ranks[i]; ++a) d.dims[i][a] = t.size(a);
}

// Local checks of q, k, v and the options; an empty string when they are fine.
std::string local_problem(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options) {
  std::ostringstream m;
  if (!q.defined() || !k.defined() || !v.defined()) return "q, k and v must all be defined";
  if (q.dim() < 2 || q.dim() > 4 || k.dim() != q.dim() || v.dim() != q.dim()) {
    m << "q " << q.shape() << ", k " << k.shape() << ", v " << v.shape() << " must all have rank 2, 3 or 4 (the same)";
    return m.str();
  }
  const Tensor q4 = q.dim() == 4 ? q : (q.dim() == 3 ? q.unsqueeze(1) : q.unsqueeze(0).unsqueeze(0));
  const Tensor k4 = k.dim() == 4 ? k : (k.dim() == 3 ? k.unsqueeze(1) : k.unsqueeze(0).unsqueeze(0));
  const Tensor v4 = v.dim() == 4 ? v : (v.dim() == 3 ? v.unsqueeze(1) : v.unsqueeze(0).unsqueeze(0));
  if (q4.size(0) != k4.size(0) || k4.size(0) != v4.size(0) || k4.size(1) != v4.size(1) || k4.size(1) == 0 ||
      q4.size(1) % k4.size(1) != 0 || q4.size(3) != k4.size(3) || q4.size(2) != k4.size(2) ||
      k4.size(2) != v4.size(2) || q4.size(2) == 0) {
    m << "q " << q.shape() << ", k " << k.shape() << ", v " << v.shape()
      << " do not fit: q, k and v must hold the same n > 0 positions of the same batch, q's heads a multiple of k's, "
         "q and k the same head dim";
    return m.str();
  }
  // scale, softcap, alibi_slopes and sinks: the single-process checks and messages, on this shard.
  AttentionOptions modifiers;
  modifiers.scale = options.scale;
  modifiers.softcap = options.softcap;
  modifiers.alibi_slopes = options.alibi_slopes;
  modifiers.sinks = options.sinks;
  try {
    detail::build_problem("", q, k, v, modifiers);
  } catch (const Error& e) {
    return e.what();
  }
  if (options.dropout_p != 0) return "dropout_p = " + std::to_string(options.dropout_p) + " is not supported (0 only)";
  if (options.need_weights) return "need_weights is not supported (the weights are never gathered)";
  if (options.backend == Backend::Decode) return "backend Decode has no backward and is not offered; use Auto, Flash or Reference";
  return "";
}

Descriptor describe(const std::vector<Tensor>& tensors, const AttentionOptions& options, const std::string& problem) {
  Descriptor d;
  for (size_t i = 0; i < tensors.size() && i < 5; ++i) fill_shape(d, static_cast<int>(i), tensors[i]);
  d.band_lo = options.mask.band_lo();
  d.band_hi = options.mask.band_hi();
  d.has_lengths = options.mask.has_key_lengths();
  Hash lengths;
  for (int64_t length : options.mask.lengths()) lengths.add(static_cast<uint64_t>(length));
  d.lengths_hash = lengths.value;
  d.backend = static_cast<int32_t>(options.backend);
  d.has_scale = options.scale.has_value();
  d.scale = options.scale.value_or(0.0f);
  d.softcap = options.softcap;
  Hash modifiers;
  modifiers.add(options.alibi_slopes);
  modifiers.add(options.sinks);
  d.modifiers_hash = modifiers.value;
  Hash terms;
  terms.add(options.mask.terms().size());
  for (const Mask::Term& term : options.mask.terms()) {
    terms.add(term.additive);
    for (int64_t size : term_sizes(term.values)) terms.add(static_cast<uint64_t>(size));
  }
  d.terms_hash = terms.value;
  if (!problem.empty()) {
    d.ok = 0;
    std::strncpy(d.message, problem.c_str(), sizeof(d.message) - 1);
  }
  return d;
}

// Gathers every rank's descriptor and throws the same qkv::Error on every rank when any rank
// reported a problem or the ranks disagree. `names` label the tensors in messages.
void agree(const Descriptor& mine, const Comm& comm, const char* who, const std::vector<const char*>& names) {
  std::vector<Descriptor> all(static_cast<size_t>(comm.size()));
  check_mpi(MPI_Allgather(&mine, sizeof(Descriptor), MPI_BYTE, all.data(), sizeof(Descriptor), MPI_BYTE, comm.get()),
            "MPI_Allgather of the shapes");
  for (int r = 0; r < comm.size(); ++r) {
    const Descriptor& d = all[static_cast<size_t>(r)];
    if (!d.ok) throw Error(std::string(who) + ": rank " + std::to_string(r) + ": " + d.message);
  }
  const auto shapes = [&](int r) {
    std::string s;
    for (size_t i = 0; i < names.size(); ++i)
      s += std::string(i ? ", " : "") + names[i] + " " + dims_str(all[static_cast<size_t>(r)], static_cast<int>(i));
    return s;
  };
  for (int r = 1; r < comm.size(); ++r) {
    const Descriptor& a = all[0];
    const Descriptor& b = all[static_cast<size_t>(r)];
    bool same_shapes = std::memcmp(a.ranks, b.ranks, sizeof(a.ranks)) == 0 && std::memcmp(a.dims, b.dims, sizeof(a.dims)) == 0;
    if (!same_shapes)
      throw Error(std::string(who) + ": the shards differ across the " + std::to_string(comm.size()) +
                  " ranks: rank 0 has " + shapes(0) + " but rank " + std::to_string(r) + " has " + shapes(r) +
                  "; every rank must pass N/P positions of the same tensors (N divisible by P = " +
                  std::to_string(comm.size()) + ")");
    if (a.band_lo != b.band_lo || a.band_hi != b.band_hi || a.has_lengths != b.has_lengths ||
        a.lengths_hash != b.lengths_hash || a.backend != b.backend || a.has_scale != b.has_scale ||
        (a.has_scale && a.scale != b.scale) || a.softcap != b.softcap || a.modifiers_hash != b.modifiers_hash)
      throw Error(std::string(who) + ": rank " + std::to_string(r) + " passed different options (mask, scale, "
                  "backend, softcap, alibi_slopes or sinks) than rank 0; every rank must pass the same "
                  "AttentionOptions");
    if (a.terms_hash != b.terms_hash)
      throw Error(std::string(who) + ": rank " + std::to_string(r) + " passed tensor masks of other kinds or "
                  "broadcast shapes than rank 0; every rank must pass the same terms, each holding the rows of "
                  "its own queries over all N keys (or broadcasting the same dims)");
  }
}

Layout make_layout(const Comm& comm, int64_t n, const Mask& mask) {
  Layout l;
  l.ranks = comm.size();
  l.rank = comm.rank();
  l.n = n;
  const bool causal_band = mask.band_lo() <= -Mask::kUnbounded && mask.band_hi() < Mask::kUnbounded;
  l.zigzag = causal_band && l.ranks > 1 && n % 2 == 0;
  l.chunk = l.zigzag ? n / 2 : n;
  l.chunks = l.zigzag ? 2 : 1;
  return l;
}

// Global key lengths must lie in [0, N]; checked here because each pair sees them clamped.
std::string lengths_problem(const Mask& mask, int64_t batch, int64_t total) {
  if (!mask.has_key_lengths()) return "";
  const auto& lengths = mask.lengths();
  if (static_cast<int64_t>(lengths.size()) != batch)
    return "mask key_lengths has " + std::to_string(lengths.size()) + " lengths but the batch is " + std::to_string(batch);
  for (size_t b = 0; b < lengths.size(); ++b)
    if (lengths[b] < 0 || lengths[b] > total)
      return "mask key_lengths[" + std::to_string(b) + "] = " + std::to_string(lengths[b]) +
             " is outside [0, N = " + std::to_string(total) + "] (global positions)";
  return "";
}

// Tensor mask terms are sharded as the queries: rank r passes the rows of its n queries over all
// N keys, a tensor that broadcasts to (B, Hq, n, N) as a single call's broadcasts to (B, Hq, Nq, Nk).
std::string terms_problem(const Mask& mask, const Tensor& q4, int64_t total) {
  const int64_t n = q4.size(2);
  const std::vector<int64_t> want{q4.size(0), q4.size(1), n, total};
  for (const Mask::Term& term : mask.terms()) {
    const std::vector<int64_t> sizes = term_sizes(term.values);
    bool fits = !sizes.empty();
    for (size_t d = 0; fits && d < 4; ++d) fits = sizes[d] == want[d] || sizes[d] == 1;
    if (!fits)
      return std::string("mask ") + (term.additive ? "additive" : "keep") + term.values.shape().str() +
             " does not broadcast to (B, Hq, n, N) = " + Shape(want).str() +
             ": each rank passes the rows of its own n = " + std::to_string(n) + " queries over all N = " +
             std::to_string(total) + " keys";
  }
  return "";
}

// o1, lse1 (accumulated) <- the log-sum-exp merge with o2, lse2, row by row
// (merge_softmax_parts, attention/lse_merge.hpp: a result (O, lse) is the part (lse, 1, O)); a row
// with both -inf stays (0, -inf), never NaN.
void merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2) {
  const int64_t rows = lse1.numel(), d = o1.size(3);
  float* a = o1.data();
  float* la = lse1.data();
  const float* b = o2.data();
  const float* lb = lse2.data();
#pragma omp parallel for schedule(static) if (rows * d > 65536)
  for (int64_t row = 0; row < rows; ++row) {
    if (lb[row] == kMinusInf) continue;  // nothing new for this row
    float* x = a + row * d;
    const detail::SoftmaxPart parts[2] = {{la[row], 1.0f, x}, {lb[row], 1.0f, b + row * d}};
    la[row] = detail::merge_softmax_parts(2, [&](int64_t c) { return parts[c]; }, static_cast<size_t>(d), x).lse;
  }
}

// The sinks join each row's softmax once, after the ring: a part (sinks[h], 1, zeros). out
// (B, H, rows, D) and lse (B, H, rows) are merged with it in place; a row that saw no key gets
// output 0 and lse = sinks[h], as in a single call.
void merge_sinks(const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  const int64_t heads = out.size(1), rows = out.size(2), d = out.size(3);
  const int64_t all_rows = out.size(0) * heads * rows;
  const std::vector<float> sink = sinks.to_vector();
  float* x = out.data();
  float* la = lse.data();
  for (int64_t row = 0; row < all_rows; ++row) {
    const detail::SoftmaxPart parts[2] = {{la[row], 1.0f, x + row * d},
                                          {sink[static_cast<size_t>(row / rows % heads)], 1.0f, nullptr}};
    la[row] = detail::merge_softmax_parts(2, [&](int64_t c) { return parts[c]; }, static_cast<size_t>(d), x + row * d).lse;
  }
}

// dsinks[h] = -sum over the rows of head h of exp(sinks[h] - lse) (dO . O) (sink_gradient_of_row,
// attention/lse_merge.hpp, as every backward kernel's). go4, o4 (B, H, n, Dv) and lse4 (B, H, n, 1)
// are this rank's rows; the sum over every rank's is returned on every rank.
Tensor ring_sink_gradients(const Tensor& go4, const Tensor& o4, const Tensor& lse4, const Tensor& sinks,
                           const Comm& comm) {
  const int64_t heads = o4.size(1), rows = o4.size(2), d = o4.size(3);
  const std::vector<float> sink = sinks.to_vector();
  std::vector<double> sums(static_cast<size_t>(heads), 0.0);
  const float* go = go4.data();
  const float* o = o4.data();
  const float* lse = lse4.data();
  for (int64_t row = 0; row < o4.size(0) * heads * rows; ++row) {
    const size_t h = static_cast<size_t>(row / rows % heads);
    sums[h] += detail::sink_gradient_of_row(sink[h], lse[row], 1.0f, go + row * d, o + row * d, d);
  }
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, sums.data(), static_cast<int>(heads), MPI_DOUBLE, MPI_SUM, comm.get()),
            "MPI_Allreduce of dsinks");
  Tensor dsinks = Tensor::empty(sinks.shape());
  for (int64_t h = 0; h < heads; ++h) dsinks.data()[h] = static_cast<float>(sums[static_cast<size_t>(h)]);
  return dsinks;
}

void add_into(float* dst, const float* src, int64_t count) {
#pragma omp parallel for schedule(static) if (count > 65536)
  for (int64_t i = 0; i < count; ++i) dst[i] += src[i];
}

// A (B, H, rows, D) view into a ring buffer, kept alive by the buffer tensor.
Tensor view(const Tensor& buffer, int64_t offset, const Shape& shape) {
  return Tensor::from_blob(buffer.data() + offset, shape, std::make_shared<Tensor>(buffer));
}

// The K/V chunks of one block laid out in one buffer: chunk 0's k, v, then chunk 1's k, v.
struct BlockLayout {
  Shape k_shape, v_shape;
  int64_t k_size = 0, v_size = 0, chunks = 1;
  int64_t total() const { return chunks * (k_size + v_size); }
  Tensor k(const Tensor& buf, int64_t c) const { return view(buf, c * (k_size + v_size), k_shape); }
  Tensor v(const Tensor& buf, int64_t c) const { return view(buf, c * (k_size + v_size) + k_size, v_shape); }
};

BlockLayout block_layout(const Tensor& k4, const Tensor& v4, const Layout& layout) {
  BlockLayout b;
  b.k_shape = Shape{k4.size(0), k4.size(1), layout.chunk, k4.size(3)};
  b.v_shape = Shape{v4.size(0), v4.size(1), layout.chunk, v4.size(3)};
  b.k_size = b.k_shape.numel();
  b.v_size = b.v_shape.numel();
  b.chunks = layout.chunks;
  return b;
}

Shape shape_like(const Tensor& original, const Tensor& t4) {
  if (original.dim() == 4) return t4.shape();
  if (original.dim() == 3) return Shape{t4.size(0), t4.size(2), t4.size(3)};
  return Shape{t4.size(2), t4.size(3)};
}

Shape lse_shape_like(const Tensor& original, const Tensor& q4) {
  if (original.dim() == 4) return Shape{q4.size(0), q4.size(1), q4.size(2)};
  if (original.dim() == 3) return Shape{q4.size(0), q4.size(2)};
  return Shape{q4.size(2)};
}

Tensor poisoned(const Shape& shape) { return Tensor::full(shape, std::numeric_limits<float>::quiet_NaN()); }

Tensor filled(Tensor t, float value) {
  std::fill_n(t.data(), t.numel(), value);
  return t;
}

}  // namespace

void release_ring_workspaces() { workspace = Workspace(); }

AttentionResult ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, MPI_Comm parent,
                               const AttentionOptions& options, RingStats* stats_out) {
  const auto start = Clock::now();
  RingStats stats;
  Comm comm(parent);
  const char* who = "ring_attention";
  std::string problem = local_problem(q, k, v, options);
  if (problem.empty()) problem = lengths_problem(options.mask, as4(q).size(0), q.size(-2) * comm.size());
  if (problem.empty()) problem = terms_problem(options.mask, as4(q), q.size(-2) * comm.size());
  agree(describe({q, k, v}, options, problem), comm, who, {"q", "k", "v"});

  const Tensor q4 = as4(q), k4 = as4(k), v4 = as4(v);
  const Layout layout = make_layout(comm, q4.size(2), options.mask);
  const int p = layout.ranks, r = layout.rank;
  const int right = (r + 1) % p, left = (r + p - 1) % p;

  // Entry: this rank's query chunks and its K/V block in ring buffer 0.
  const BlockLayout bl = block_layout(k4, v4, layout);
  Tensor buffers[2] = {workspace.get(0, Shape{bl.total()}), workspace.get(1, Shape{bl.total()})};
  std::vector<Tensor> q_chunks, k_chunks, v_chunks;
  Terms terms;
  {
    Requests requests;
    q_chunks = scatter_chunks(q4, layout, comm, 0, requests, stats);
    k_chunks = scatter_chunks(k4, layout, comm, 1, requests, stats);
    v_chunks = scatter_chunks(v4, layout, comm, 2, requests, stats);
    terms = scatter_terms(options.mask, layout, comm, 3, requests, stats);
    requests.wait(stats);
  }
  for (int c = 0; c < layout.chunks; ++c) {
    std::memcpy(bl.k(buffers[0], c).data(), k_chunks[static_cast<size_t>(c)].data(), sizeof(float) * static_cast<size_t>(bl.k_size));
    std::memcpy(bl.v(buffers[0], c).data(), v_chunks[static_cast<size_t>(c)].data(), sizeof(float) * static_cast<size_t>(bl.v_size));
  }

  // Accumulators per query chunk: output 0 and lse -inf (no key seen yet). Without zigzag the
  // one chunk is this rank's shard, so the accumulators are the results themselves.
  const bool direct = !layout.zigzag;
  std::vector<Tensor> out_chunks, lse_chunks;
  for (int c = 0; c < layout.chunks; ++c) {
    const Shape out_shape{q4.size(0), q4.size(1), layout.chunk, v4.size(3)}, lse_shape{q4.size(0), q4.size(1), layout.chunk};
    const size_t slot = 2 + 2 * static_cast<size_t>(c);
    out_chunks.push_back(direct ? Tensor::zeros(out_shape) : filled(workspace.get(slot, out_shape), 0.0f));
    lse_chunks.push_back(direct ? Tensor::full(lse_shape, kMinusInf) : filled(workspace.get(slot + 1, lse_shape), kMinusInf));
  }

  // The pairs see no sinks (merge_sinks adds them once per row after the ring), and ALiBi's
  // distances of the whole sequence through alibi_shift (src/attention/ring_block.hpp).
  AttentionOptions pair_options = options;
  pair_options.sinks = Tensor();
  if (workspace.pair.output.defined() &&
      workspace.pair.output.shape() != Shape{q4.size(0), q4.size(1), layout.chunk, v4.size(3)})
    workspace.pair = AttentionResult();  // another problem's shapes: let the next call allocate
  for (int step = 0; step < p; ++step) {
    const Tensor& current = buffers[step % 2];
    const int source = (r - step + p) % p;  // whose K/V block this is
    Requests requests;
    if (step + 1 < p) {
      requests.recv(buffers[(step + 1) % 2].data(), bl.total(), left, kTagKv, comm.get());
      requests.send(current.data(), bl.total(), right, kTagKv, comm.get(), stats);
    }
    const auto compute_start = Clock::now();
    for (int qc = 0; qc < layout.chunks; ++qc) {
      for (int kc = 0; kc < layout.chunks; ++kc) {
        const int64_t qs = layout.start(r, qc), ks = layout.start(source, kc);
        if (!pair_mask(options.mask, qs, layout.chunk, ks, layout.chunk, pair_options.mask)) continue;
        add_pair_terms(terms, qc, ks, layout.chunk, pair_options.mask);
        AttentionResult& part = workspace.pair;
        detail::block_attention_into(q_chunks[static_cast<size_t>(qc)], bl.k(current, kc), bl.v(current, kc), part,
                                     pair_options, qs - ks);
        merge(out_chunks[static_cast<size_t>(qc)], lse_chunks[static_cast<size_t>(qc)], part.output, part.lse);
        ++stats.blocks_computed;
        requests.poke();
      }
    }
    stats.compute_seconds += seconds_since(compute_start);
    requests.wait(stats);
  }

  if (options.sinks.defined())
    for (int c = 0; c < layout.chunks; ++c)
      merge_sinks(out_chunks[static_cast<size_t>(c)], lse_chunks[static_cast<size_t>(c)], options.sinks);

  // Exit: the chunks go back to the contiguous shards.
  AttentionResult result;
  Tensor out4 = out_chunks[0], lse4 = lse_chunks[0].unsqueeze(3);
  if (!direct) {
    out4 = poisoned(Shape{q4.size(0), q4.size(1), q4.size(2), v4.size(3)});
    lse4 = poisoned(Shape{q4.size(0), q4.size(1), q4.size(2), 1});
    std::vector<Tensor> lse_rows;
    for (const Tensor& t : lse_chunks) lse_rows.push_back(t.unsqueeze(3));
    gather_chunks(out_chunks, out4, layout, comm, 0, stats);
    gather_chunks(lse_rows, lse4, layout, comm, 1, stats);
  }
  result.output = out4.reshape(shape_like(q, out4));
  result.lse = lse4.reshape(lse_shape_like(q, q4));
  stats.total_seconds = seconds_since(start);
  if (stats_out) *stats_out = stats;
  return result;
}

AttentionGrads ring_attention_backward(const Tensor& grad_output, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const AttentionResult& forward, MPI_Comm parent, const AttentionOptions& options,
                                       RingStats* stats_out) {
  const auto start = Clock::now();
  RingStats stats;
  Comm comm(parent);
  const char* who = "ring_attention_backward";
  std::string problem = local_problem(q, k, v, options);
  if (problem.empty()) problem = lengths_problem(options.mask, as4(q).size(0), q.size(-2) * comm.size());
  if (problem.empty()) problem = terms_problem(options.mask, as4(q), q.size(-2) * comm.size());
  if (problem.empty()) {
    // grad_output and forward.output shaped as q's leading dims + (n, Dv); lse as + (n).
    std::vector<int64_t> od = q.shape().dims(), ld = q.shape().dims();
    od.back() = v.size(-1);
    ld.pop_back();
    const Shape want_out(od), want_lse(ld);
    const auto bad = [](const Tensor& t, const Shape& want) { return !t.defined() || t.shape() != want; };
    const auto str = [](const Tensor& t) { return t.defined() ? t.shape().str() : std::string("undefined"); };
    if (bad(grad_output, want_out) || bad(forward.output, want_out) || bad(forward.lse, want_lse))
      problem = "grad_output " + str(grad_output) + ", forward.output " + str(forward.output) + " and forward.lse " +
                str(forward.lse) + " must be " + want_out.str() + ", " + want_out.str() + " and " + want_lse.str() +
                " (this rank's rows of ring_attention's result)";
  }
  agree(describe({q, k, v, grad_output, forward.lse}, options, problem), comm, who,
        {"q", "k", "v", "grad_output", "forward.lse"});

  const Tensor q4 = as4(q), k4 = as4(k), v4 = as4(v);
  const Tensor go4 = as4(grad_output), o4 = as4(forward.output);
  const Tensor lse4 = forward.lse.contiguous().reshape(Shape{q4.size(0), q4.size(1), q4.size(2), 1});
  const Layout layout = make_layout(comm, q4.size(2), options.mask);
  const int p = layout.ranks, r = layout.rank;
  const int right = (r + 1) % p, left = (r + p - 1) % p;

  const BlockLayout bl = block_layout(k4, v4, layout);  // also the layout of a dK/dV accumulator
  Tensor kv[2] = {workspace.get(0, Shape{bl.total()}), workspace.get(1, Shape{bl.total()})};
  std::vector<Tensor> q_chunks, k_chunks, v_chunks, go_chunks, o_chunks, lse_chunks;
  Terms terms;
  {
    Requests requests;
    q_chunks = scatter_chunks(q4, layout, comm, 0, requests, stats);
    k_chunks = scatter_chunks(k4, layout, comm, 1, requests, stats);
    v_chunks = scatter_chunks(v4, layout, comm, 2, requests, stats);
    go_chunks = scatter_chunks(go4, layout, comm, 3, requests, stats);
    o_chunks = scatter_chunks(o4, layout, comm, 4, requests, stats);
    lse_chunks = scatter_chunks(lse4, layout, comm, 5, requests, stats);
    terms = scatter_terms(options.mask, layout, comm, 6, requests, stats);
    requests.wait(stats);
  }
  for (int c = 0; c < layout.chunks; ++c) {
    std::memcpy(bl.k(kv[0], c).data(), k_chunks[static_cast<size_t>(c)].data(), sizeof(float) * static_cast<size_t>(bl.k_size));
    std::memcpy(bl.v(kv[0], c).data(), v_chunks[static_cast<size_t>(c)].data(), sizeof(float) * static_cast<size_t>(bl.v_size));
  }
  std::vector<AttentionResult> forwards;  // per query chunk: the global output and lse rows
  std::vector<Tensor> dq_chunks;
  for (int c = 0; c < layout.chunks; ++c) {
    AttentionResult f;
    f.output = o_chunks[static_cast<size_t>(c)];
    f.lse = lse_chunks[static_cast<size_t>(c)].squeeze(3);
    forwards.push_back(f);
    const Shape dq_shape = q_chunks[static_cast<size_t>(c)].shape();
    dq_chunks.push_back(layout.zigzag ? filled(workspace.get(7 + static_cast<size_t>(c), dq_shape), 0.0f)
                                      : Tensor::zeros(dq_shape));  // without zigzag: the result itself
  }

  // dK/dV buffers: this step's contribution, the accumulator arriving from the left, and the one
  // leaving to the right (still in flight from the previous step).
  Tensor contribution = workspace.get(2, Shape{bl.total()});
  Tensor arriving = workspace.get(3, Shape{bl.total()});
  Tensor leaving = workspace.get(4, Shape{bl.total()});
  Requests grad_sends, grad_recv;
  AttentionOptions pair_options = options;
  pair_options.sinks = Tensor();  // forward.lse includes them; dsinks come from the rows alone
  AttentionGrads g;               // one pair's gradients, reused pair after pair
  for (int step = 0; step < p; ++step) {
    const Tensor& current = kv[step % 2];
    const int source = (r - step + p) % p;
    Requests kv_requests;
    if (step + 1 < p) {
      kv_requests.recv(kv[(step + 1) % 2].data(), bl.total(), left, kTagKv, comm.get());
      kv_requests.send(current.data(), bl.total(), right, kTagKv, comm.get(), stats);
    }
    if (step > 0) grad_recv.recv(arriving.data(), bl.total(), left, kTagGrad, comm.get());

    const auto compute_start = Clock::now();
    std::memset(contribution.data(), 0, sizeof(float) * static_cast<size_t>(bl.total()));
    for (int qc = 0; qc < layout.chunks; ++qc) {
      for (int kc = 0; kc < layout.chunks; ++kc) {
        const int64_t qs = layout.start(r, qc), ks = layout.start(source, kc);
        if (!pair_mask(options.mask, qs, layout.chunk, ks, layout.chunk, pair_options.mask)) continue;
        add_pair_terms(terms, qc, ks, layout.chunk, pair_options.mask);
        const size_t i = static_cast<size_t>(qc);
        detail::block_attention_backward_into(go_chunks[i], q_chunks[i], bl.k(current, kc), bl.v(current, kc),
                                              forwards[i], g, pair_options, qs - ks);
        add_into(dq_chunks[i].data(), g.dq.data(), g.dq.numel());
        add_into(bl.k(contribution, kc).data(), g.dk.data(), g.dk.numel());
        add_into(bl.v(contribution, kc).data(), g.dv.data(), g.dv.numel());
        ++stats.blocks_computed;
        kv_requests.poke();
        grad_recv.poke();
      }
    }
    stats.compute_seconds += seconds_since(compute_start);
    if (step > 0) {
      grad_recv.wait(stats);
      add_into(contribution.data(), arriving.data(), bl.total());
    }
    grad_sends.wait(stats);  // the previous step's accumulator has left: its buffer is free
    std::swap(contribution, leaving);
    grad_sends.send(leaving.data(), bl.total(), right, kTagGrad, comm.get(), stats);
    kv_requests.wait(stats);
  }
  // The accumulator of this rank's own block has visited every rank and arrives from the left.
  grad_recv.recv(arriving.data(), bl.total(), left, kTagGrad, comm.get());
  grad_recv.wait(stats);
  grad_sends.wait(stats);

  std::vector<Tensor> dk_chunks, dv_chunks;
  for (int c = 0; c < layout.chunks; ++c) {
    dk_chunks.push_back(bl.k(arriving, c));
    dv_chunks.push_back(bl.v(arriving, c));
  }
  Tensor dq4 = layout.zigzag ? poisoned(q4.shape()) : dq_chunks[0];
  Tensor dk4 = poisoned(k4.shape()), dv4 = poisoned(v4.shape());
  if (layout.zigzag) gather_chunks(dq_chunks, dq4, layout, comm, 2, stats);
  gather_chunks(dk_chunks, dk4, layout, comm, 3, stats);
  gather_chunks(dv_chunks, dv4, layout, comm, 4, stats);
  AttentionGrads grads{dq4.reshape(q.shape()), dk4.reshape(k.shape()), dv4.reshape(v.shape()), Tensor()};
  if (options.sinks.defined()) grads.dsinks = ring_sink_gradients(go4, o4, lse4, options.sinks, comm);
  stats.total_seconds = seconds_since(start);
  if (stats_out) *stats_out = stats;
  return grads;
}

}  // namespace qkv::dist

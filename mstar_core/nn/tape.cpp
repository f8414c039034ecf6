// A recorded run of CPU kernel calls, replayed without Python: built by native.py, driven by tape.py.
//
// A decode step of a small model is ~330 kernel calls (121 linears, norms, rotary, attention, adds; Whisper's decoder
// also LayerNorms, GELUs and cross-attention over its encoder keys); from Python
// each costs its wrapper's checks, a ctypes call and an allocation, ~2.5 ms a SmolLM2 step against ~4.5 ms of
// linears. Recorded once (every pointer and size as the kernel got it), the same calls replay here in one loop.
//
// A call's arguments are int64 slots in the order of its C signature: pointers and integers as they are, a float
// as its 32 bits. `kind` names the signature (tape.py maps each ctypes signature it records to one of these).

#include <chrono>
#include <cstdint>
#include <cstring>

namespace {

enum Kind : int64_t {
    LINEAR = 1,         // int (x, x_row, packed, bias, out, out_row, m, n, k, threads, next)
    LINEAR_SCALED = 2,  // int (x, x_row, packed, scale, bias, out, out_row, m, n, k, threads, next)
    RMS_NORM = 3,       // void (x, x_row, weight, out, rows, dim, eps, threads)
    ADD_RMS_NORM = 4,   // void (delta, residual, res_row, weight, out, rows, dim, eps, threads)
    SILU_MUL = 5,       // void (gate_up, row, out, rows, width, threads)
    ROTARY = 6,         // void (x, row, head, rows, heads, rot, cos, sin, threads)
    LANE = 7,           // int (plan, q, k, v, k_lanes, v_lanes, k_pool, v_pool, out)
    ADD = 8,            // void (acc, other, other_row, rows, dim, threads)
    RMS_NORM_HEADS = 9, // void (x, row, head, rows, heads, dim, weight, out, eps, threads)
    GELU = 10,          // void (x, count, threads)
    CROSS = 11,         // int (plan, q, keys, values, out)
    LAYER_NORM = 12,    // void (x, x_row, weight, bias, out, rows, dim, eps, threads)
    ARGMAX = 13,        // void (x, row, rows, width, out, threads): greedy tokens of logits (next_token.cpp)
};

constexpr int MAX_ARGS = 12;

struct Op {
    void *fn;
    int64_t kind;
    int64_t a[MAX_ARGS];
};

inline void *p(int64_t v) { return reinterpret_cast<void *>(v); }
inline int n(int64_t v) { return static_cast<int>(v); }
inline float f(int64_t v) {
    const int32_t bits = static_cast<int32_t>(v);
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
}

template <typename R, typename... A>
inline R (*as(void *fn))(A...) {
    return reinterpret_cast<R (*)(A...)>(fn);
}

using i64 = int64_t;
using ptr = void *;

int run(const Op &o) {
    const int64_t *a = o.a;
    switch (o.kind) {
        case LINEAR:
            return as<int, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, int, ptr>(o.fn)(
                p(a[0]), a[1], p(a[2]), p(a[3]), p(a[4]), a[5], a[6], a[7], a[8], n(a[9]), p(a[10]));
        case LINEAR_SCALED:
            return as<int, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, int, ptr>(o.fn)(
                p(a[0]), a[1], p(a[2]), p(a[3]), p(a[4]), p(a[5]), a[6], a[7], a[8], a[9], n(a[10]), p(a[11]));
        case RMS_NORM:
            as<void, ptr, i64, ptr, ptr, i64, i64, float, int>(o.fn)(p(a[0]), a[1], p(a[2]), p(a[3]), a[4], a[5], f(a[6]),
                                                                     n(a[7]));
            return 0;
        case ADD_RMS_NORM:
            as<void, ptr, ptr, i64, ptr, ptr, i64, i64, float, int>(o.fn)(p(a[0]), p(a[1]), a[2], p(a[3]), p(a[4]), a[5],
                                                                          a[6], f(a[7]), n(a[8]));
            return 0;
        case SILU_MUL:
            as<void, ptr, i64, ptr, i64, i64, int>(o.fn)(p(a[0]), a[1], p(a[2]), a[3], a[4], n(a[5]));
            return 0;
        case ROTARY:
            as<void, ptr, i64, i64, i64, i64, i64, ptr, ptr, int>(o.fn)(p(a[0]), a[1], a[2], a[3], a[4], a[5], p(a[6]),
                                                                        p(a[7]), n(a[8]));
            return 0;
        case LANE:
            return as<int, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr>(o.fn)(p(a[0]), p(a[1]), p(a[2]), p(a[3]), p(a[4]),
                                                                             p(a[5]), p(a[6]), p(a[7]), p(a[8]));
        case ADD:
            as<void, ptr, ptr, i64, i64, i64, int>(o.fn)(p(a[0]), p(a[1]), a[2], a[3], a[4], n(a[5]));
            return 0;
        case RMS_NORM_HEADS:
            as<void, ptr, i64, i64, i64, i64, i64, ptr, ptr, float, int>(o.fn)(p(a[0]), a[1], a[2], a[3], a[4], a[5],
                                                                            p(a[6]), p(a[7]), f(a[8]), n(a[9]));
            return 0;
        case GELU:
            as<void, ptr, i64, int>(o.fn)(p(a[0]), a[1], n(a[2]));
            return 0;
        case CROSS:
            return as<int, ptr, ptr, ptr, ptr, ptr>(o.fn)(p(a[0]), p(a[1]), p(a[2]), p(a[3]), p(a[4]));
        case LAYER_NORM:
            as<void, ptr, i64, ptr, ptr, ptr, i64, i64, float, int>(o.fn)(p(a[0]), a[1], p(a[2]), p(a[3]), p(a[4]), a[5],
                                                                          a[6], f(a[7]), n(a[8]));
            return 0;
        case ARGMAX:
            as<void, ptr, i64, i64, i64, ptr, int>(o.fn)(p(a[0]), a[1], a[2], a[3], p(a[4]), n(a[5]));
            return 0;
        default:
            return -1;
    }
}

}  // namespace

extern "C" {

// bytes of one recorded call (tape.py checks its layout against this)
int64_t mstar_tape_op_bytes() { return sizeof(Op); }

// run `count` recorded calls in order; 0, or 1 + the index of the first call that failed (its kernel refused)
int64_t mstar_tape_run(const Op *ops, int64_t count) {
    for (int64_t i = 0; i < count; ++i)
        if (run(ops[i]) != 0) return i + 1;
    return 0;
}

// the same, each call's wall time in nanoseconds into ns[i] (a benchmark's split of a replayed step by kernel)
int64_t mstar_tape_run_timed(const Op *ops, int64_t count, int64_t *ns) {
    using clock = std::chrono::steady_clock;
    for (int64_t i = 0; i < count; ++i) {
        const auto started = clock::now();
        const int failed = run(ops[i]);
        ns[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - started).count();
        if (failed != 0) return i + 1;
    }
    return 0;
}

}  // extern "C"

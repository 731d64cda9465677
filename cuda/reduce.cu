// ferroccl device reduction kernels, compiled at run time with NVRTC (src/cuda/mod.rs).
//
// Every kernel is `extern "C"` so its PTX entry has a fixed name:
//
//   ferroccl_reduce_<dt>_<op>(T* dst, const T* a, const T* b, u64 n)
//       dst[i] = a[i] op b[i]. `dst` may be `a` (in place). `b` may be another process's
//       memory opened through CUDA IPC.
//   ferroccl_reduce_copy_<dt>_<op>(T* dst, T* dst2, const T* a, const T* b, u64 n)
//       The ring's fused receive-reduce-copy step: the same result written to `dst` and
//       `dst2` (the next send slot); `dst2` may be null.
//   ferroccl_scale_<dt>(T* dst, u64 n, double divisor)
//       dst[i] = dst[i] / divisor: the last step of Avg (float types only).
//
// dt: f32 f64 f16 bf16 i32 i64 u8; op: sum prod min max avg (avg: float types only).
//
// Semantics are those of the CPU kernels in src/reduce.rs, element for element:
// - f16/bf16 are widened to f32, combined in f32, rounded once (to nearest even).
// - Avg combines like Sum; the division happens once, in ferroccl_scale_* (a true
//   division, not a multiplication by 1/n, so the quotient is correctly rounded in f32
//   for f32/f16/bf16 and in f64 for f64).
// - Integer Sum/Prod wrap (computed in unsigned arithmetic: no signed-overflow UB).
// - Float Min/Max are IEEE minNum/maxNum (fminf/fmaxf): a NaN loses to a number.
//
// Layout: grid-stride loops over 16-byte vectors (uint4 loads and stores; f16 and bf16
// combined two lanes at a time as half2 / nv_bfloat162 widened to float2), with a scalar
// head (when the pointers share a misalignment) and a scalar tail. Pointers whose
// misalignments differ take the scalar loop throughout.
//
// Compile with NVRTC and no fast-math flags: -prec-div=true and -ftz=false (the NVRTC
// defaults) are what makes f32 results bit-identical to the CPU's.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned long long ferroccl_u64;

namespace ferroccl {

enum { SUM = 0, PROD = 1, MIN = 2, MAX = 3, AVG = 4 };

// Combining in the accumulation type.
template <int OP> __device__ __forceinline__ float combine(float a, float b) {
    return OP == PROD ? a * b : OP == MIN ? fminf(a, b) : OP == MAX ? fmaxf(a, b) : a + b;
}
template <int OP> __device__ __forceinline__ double combine(double a, double b) {
    return OP == PROD ? a * b : OP == MIN ? fmin(a, b) : OP == MAX ? fmax(a, b) : a + b;
}
template <int OP> __device__ __forceinline__ int combine(int a, int b) {
    unsigned ua = (unsigned)a, ub = (unsigned)b;
    return OP == PROD ? (int)(ua * ub) : OP == MIN ? (a < b ? a : b)
         : OP == MAX ? (a > b ? a : b) : (int)(ua + ub);
}
template <int OP> __device__ __forceinline__ long long combine(long long a, long long b) {
    ferroccl_u64 ua = (ferroccl_u64)a, ub = (ferroccl_u64)b;
    return OP == PROD ? (long long)(ua * ub) : OP == MIN ? (a < b ? a : b)
         : OP == MAX ? (a > b ? a : b) : (long long)(ua + ub);
}
template <int OP> __device__ __forceinline__ unsigned combine(unsigned a, unsigned b) {
    return OP == PROD ? a * b : OP == MIN ? (a < b ? a : b) : OP == MAX ? (a > b ? a : b) : a + b;
}

// Element type -> accumulation type and back.
template <typename T> struct Acc;
template <> struct Acc<float> {
    typedef float A;
    static __device__ __forceinline__ float up(float x) { return x; }
    static __device__ __forceinline__ float down(float x) { return x; }
};
template <> struct Acc<double> {
    typedef double A;
    static __device__ __forceinline__ double up(double x) { return x; }
    static __device__ __forceinline__ double down(double x) { return x; }
};
template <> struct Acc<__half> {
    typedef float A;
    static __device__ __forceinline__ float up(__half x) { return __half2float(x); }
    static __device__ __forceinline__ __half down(float x) { return __float2half_rn(x); }
};
template <> struct Acc<__nv_bfloat16> {
    typedef float A;
    static __device__ __forceinline__ float up(__nv_bfloat16 x) { return __bfloat162float(x); }
    static __device__ __forceinline__ __nv_bfloat16 down(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Acc<int> {
    typedef int A;
    static __device__ __forceinline__ int up(int x) { return x; }
    static __device__ __forceinline__ int down(int x) { return x; }
};
template <> struct Acc<long long> {
    typedef long long A;
    static __device__ __forceinline__ long long up(long long x) { return x; }
    static __device__ __forceinline__ long long down(long long x) { return x; }
};
template <> struct Acc<unsigned char> {
    typedef unsigned A;
    static __device__ __forceinline__ unsigned up(unsigned char x) { return x; }
    static __device__ __forceinline__ unsigned char down(unsigned x) { return (unsigned char)x; }
};

template <typename T, int OP> __device__ __forceinline__ T combine1(T a, T b) {
    return Acc<T>::down(combine<OP>(Acc<T>::up(a), Acc<T>::up(b)));
}

// One 16-byte vector: 16 / sizeof(T) lanes.
template <typename T, int OP> struct Vec {
    static __device__ __forceinline__ uint4 apply(uint4 x, uint4 y) {
        uint4 r;
        const T* ex = reinterpret_cast<const T*>(&x);
        const T* ey = reinterpret_cast<const T*>(&y);
        T* er = reinterpret_cast<T*>(&r);
#pragma unroll
        for (int k = 0; k < (int)(16 / sizeof(T)); ++k) er[k] = combine1<T, OP>(ex[k], ey[k]);
        return r;
    }
};
template <int OP> struct Vec<__half, OP> {
    static __device__ __forceinline__ uint4 apply(uint4 x, uint4 y) {
        uint4 r;
        const __half2* hx = reinterpret_cast<const __half2*>(&x);
        const __half2* hy = reinterpret_cast<const __half2*>(&y);
        __half2* hr = reinterpret_cast<__half2*>(&r);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float2 fx = __half22float2(hx[k]);
            float2 fy = __half22float2(hy[k]);
            hr[k] = __floats2half2_rn(combine<OP>(fx.x, fy.x), combine<OP>(fx.y, fy.y));
        }
        return r;
    }
};
template <int OP> struct Vec<__nv_bfloat16, OP> {
    static __device__ __forceinline__ uint4 apply(uint4 x, uint4 y) {
        uint4 r;
        const __nv_bfloat162* hx = reinterpret_cast<const __nv_bfloat162*>(&x);
        const __nv_bfloat162* hy = reinterpret_cast<const __nv_bfloat162*>(&y);
        __nv_bfloat162* hr = reinterpret_cast<__nv_bfloat162*>(&r);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float2 fx = __bfloat1622float2(hx[k]);
            float2 fy = __bfloat1622float2(hy[k]);
            hr[k] = __floats2bfloat162_rn(combine<OP>(fx.x, fy.x), combine<OP>(fx.y, fy.y));
        }
        return r;
    }
};

__device__ __forceinline__ ferroccl_u64 addr(const void* p) {
    return (ferroccl_u64)(size_t)p;
}

// dst[i] (and dst2[i] when dst2 is not null) = a[i] op b[i], for i < n.
template <typename T, int OP>
__device__ __forceinline__ void reduce_body(T* dst, T* dst2, const T* a, const T* b,
                                            ferroccl_u64 n) {
    const ferroccl_u64 tid = (ferroccl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    const ferroccl_u64 stride = (ferroccl_u64)gridDim.x * blockDim.x;
    const ferroccl_u64 lanes = 16 / sizeof(T);
    const ferroccl_u64 mis = addr(dst) & 15;
    const bool same = (addr(a) & 15) == mis && (addr(b) & 15) == mis &&
                      (dst2 == 0 || (addr(dst2) & 15) == mis) && mis % sizeof(T) == 0;
    // Scalar head up to the first 16-byte boundary (everything when misaligned apart).
    ferroccl_u64 head = same ? ((16 - mis) & 15) / sizeof(T) : n;
    if (head > n) head = n;
    const ferroccl_u64 nvec = (n - head) / lanes;
    const ferroccl_u64 body_end = head + nvec * lanes;
    for (ferroccl_u64 i = tid; i < head; i += stride) {
        T r = combine1<T, OP>(a[i], b[i]);
        dst[i] = r;
        if (dst2) dst2[i] = r;
    }
    const uint4* va = reinterpret_cast<const uint4*>(a + head);
    const uint4* vb = reinterpret_cast<const uint4*>(b + head);
    uint4* vd = reinterpret_cast<uint4*>(dst + head);
    uint4* vd2 = dst2 ? reinterpret_cast<uint4*>(dst2 + head) : 0;
    for (ferroccl_u64 v = tid; v < nvec; v += stride) {
        uint4 r = Vec<T, OP>::apply(va[v], vb[v]);
        vd[v] = r;
        if (vd2) vd2[v] = r;
    }
    for (ferroccl_u64 i = body_end + tid; i < n; i += stride) {
        T r = combine1<T, OP>(a[i], b[i]);
        dst[i] = r;
        if (dst2) dst2[i] = r;
    }
}

template <typename T> __device__ __forceinline__ void scale_body(T* dst, ferroccl_u64 n,
                                                                  double divisor) {
    const ferroccl_u64 tid = (ferroccl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    const ferroccl_u64 stride = (ferroccl_u64)gridDim.x * blockDim.x;
    const float d = (float)divisor;
    for (ferroccl_u64 i = tid; i < n; i += stride) dst[i] = Acc<T>::down(Acc<T>::up(dst[i]) / d);
}
template <> __device__ __forceinline__ void scale_body<double>(double* dst, ferroccl_u64 n,
                                                               double divisor) {
    const ferroccl_u64 tid = (ferroccl_u64)blockIdx.x * blockDim.x + threadIdx.x;
    const ferroccl_u64 stride = (ferroccl_u64)gridDim.x * blockDim.x;
    for (ferroccl_u64 i = tid; i < n; i += stride) dst[i] = dst[i] / divisor;
}

}  // namespace ferroccl

#define FERROCCL_REDUCE(T, DT, OPID, OP)                                                       \
    extern "C" __global__ void ferroccl_reduce_##DT##_##OP(T* dst, const T* a, const T* b,     \
                                                          ferroccl_u64 n) {                     \
        ferroccl::reduce_body<T, ferroccl::OPID>(dst, (T*)0, a, b, n);                         \
    }                                                                                          \
    extern "C" __global__ void ferroccl_reduce_copy_##DT##_##OP(T* dst, T* dst2, const T* a,  \
                                                               const T* b, ferroccl_u64 n) {   \
        ferroccl::reduce_body<T, ferroccl::OPID>(dst, dst2, a, b, n);                          \
    }

#define FERROCCL_INT_TYPE(T, DT)                                                               \
    FERROCCL_REDUCE(T, DT, SUM, sum)                                                           \
    FERROCCL_REDUCE(T, DT, PROD, prod)                                                         \
    FERROCCL_REDUCE(T, DT, MIN, min)                                                           \
    FERROCCL_REDUCE(T, DT, MAX, max)

#define FERROCCL_FLOAT_TYPE(T, DT)                                                             \
    FERROCCL_INT_TYPE(T, DT)                                                                   \
    FERROCCL_REDUCE(T, DT, AVG, avg)                                                           \
    extern "C" __global__ void ferroccl_scale_##DT(T* dst, ferroccl_u64 n, double divisor) {   \
        ferroccl::scale_body<T>(dst, n, divisor);                                              \
    }

FERROCCL_FLOAT_TYPE(float, f32)
FERROCCL_FLOAT_TYPE(double, f64)
FERROCCL_FLOAT_TYPE(__half, f16)
FERROCCL_FLOAT_TYPE(__nv_bfloat16, bf16)
FERROCCL_INT_TYPE(int, i32)
FERROCCL_INT_TYPE(long long, i64)
FERROCCL_INT_TYPE(unsigned char, u8)

/* emu_cublas.cpp - the CUDA emulator's cuBLAS subset (cublas_v2.h says what and how). */
#include "cublas_v2.h"
#include "emu_internal.h"

#include <string.h>

#include <vector>

struct cublasContext {
    cudaStream_t stream = NULL;
    cublasMath_t math = CUBLAS_DEFAULT_MATH;
};

using namespace emu;

namespace {

struct Mat {
    const void *p;
    cudaDataType t;
    int ld;
    long long stride; /* elements between batches */
};

size_t esize(cudaDataType t) { return t == CUDA_R_32F ? 4 : 2; }

float load(const Mat &a, size_t i)
{
    if (a.t == CUDA_R_32F) return ((const float *)a.p)[i];
    uint32_t u = (uint32_t)((const uint16_t *)a.p)[i] << 16; /* bf16: the high half */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float tf32(float x) /* round to TF32's 10 mantissa bits, nearest (CUBLAS_TF32_TENSOR_OP_MATH) */
{
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & ~0x1fffu;
    memcpy(&x, &u, 4);
    return x;
}

/* The bytes a column-major rows x cols matrix with leading dimension ld spans, over batch
 * matrices stride elements apart. */
size_t span(int rows, int cols, int ld, long long stride, int batch, size_t es)
{
    if (rows == 0 || cols == 0 || batch == 0) return 0;
    return ((size_t)(cols - 1) * ld + rows + (size_t)(batch - 1) * stride) * es;
}

bool in_device(const void *p, size_t bytes, const char *call, const char *which)
{
    if (!bytes) return true;
    int k = range_kind(p, bytes, NULL, NULL);
    if (k == MEM_DEVICE) return true;
    fault(cudaErrorIllegalAddress, "%s: matrix %s [%p, +%zu bytes) is %s", call, which, p, bytes,
          k < 0 ? "not inside one device allocation" : "not device memory");
    return false;
}

cublasStatus_t gemm(cublasHandle_t h, const char *call, cublasOperation_t ta,
                    cublasOperation_t tb, int m, int n, int k, const void *alpha, Mat A, Mat B,
                    const void *beta, float *C, int ldc, long long sc, int batch)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (api_enter(call)) return CUBLAS_STATUS_EXECUTION_FAILED;
    const int ar = ta == CUBLAS_OP_N ? m : k, ac = ta == CUBLAS_OP_N ? k : m;
    const int br = tb == CUBLAS_OP_N ? k : n, bc = tb == CUBLAS_OP_N ? n : k;
    if ((ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T) ||
        m < 0 || n < 0 || k < 0 || batch < 0 || A.ld < (ar > 1 ? ar : 1) ||
        B.ld < (br > 1 ? br : 1) || ldc < (m > 1 ? m : 1) || !alpha || !beta) {
        say("%s: invalid value: op %d/%d, m %d n %d k %d, lda %d ldb %d ldc %d, batch %d", call,
            ta, tb, m, n, k, A.ld, B.ld, ldc, batch);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (range_kind(alpha, 4, NULL, NULL) == MEM_DEVICE ||
        range_kind(beta, 4, NULL, NULL) == MEM_DEVICE) {
        say("%s: alpha or beta in device memory, with the pointer mode host", call);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    auto st = stream_get(h->stream);
    if (!st) return CUBLAS_STATUS_EXECUTION_FAILED;
    const float al = *(const float *)alpha, be = *(const float *)beta; /* read at the call */
    const bool round_tf32 = h->math == CUBLAS_TF32_TENSOR_OP_MATH && A.t == CUDA_R_32F;
    enqueue(st, [=] {
        if (faulted()) return;
        if (!in_device(A.p, span(ar, ac, A.ld, A.stride, batch, esize(A.t)), call, "A") ||
            !in_device(B.p, span(br, bc, B.ld, B.stride, batch, esize(B.t)), call, "B") ||
            !in_device(C, span(m, n, ldc, sc, batch, 4), call, "C"))
            return;
        std::vector<float> a((size_t)m * k), b((size_t)n * k);
        for (int q = 0; q < batch; q++) {
            Mat Aq = A, Bq = B;
            Aq.p = (const char *)A.p + (size_t)q * A.stride * esize(A.t);
            Bq.p = (const char *)B.p + (size_t)q * B.stride * esize(B.t);
            float *Cq = C + (size_t)q * sc;
            /* op(A) row-major (m x k) and op(B) column-major (k per column), contiguous */
            for (int i = 0; i < m; i++)
                for (int l = 0; l < k; l++) {
                    float x = load(Aq, ta == CUBLAS_OP_N ? i + (size_t)l * A.ld
                                                         : l + (size_t)i * A.ld);
                    a[(size_t)i * k + l] = round_tf32 ? tf32(x) : x;
                }
            for (int j = 0; j < n; j++)
                for (int l = 0; l < k; l++) {
                    float x = load(Bq, tb == CUBLAS_OP_N ? l + (size_t)j * B.ld
                                                         : j + (size_t)l * B.ld);
                    b[(size_t)j * k + l] = round_tf32 ? tf32(x) : x;
                }
            for (int j = 0; j < n; j++)
                for (int i = 0; i < m; i++) {
                    const float *x = &a[(size_t)i * k], *y = &b[(size_t)j * k];
                    float part[8] = {0};
                    int l = 0;
                    for (; l + 8 <= k; l += 8)
                        for (int u = 0; u < 8; u++) part[u] += x[l + u] * y[l + u];
                    for (; l < k; l++) part[l % 8] += x[l] * y[l];
                    float s = ((part[0] + part[1]) + (part[2] + part[3])) +
                              ((part[4] + part[5]) + (part[6] + part[7]));
                    float *c = &Cq[i + (size_t)j * ldc];
                    *c = be == 0.0f ? al * s : al * s + be * *c; /* beta 0: C is not read */
                }
        }
        guards_ok(C, call);
    });
    return CUBLAS_STATUS_SUCCESS;
}

} // namespace

extern "C" {

cublasStatus_t cublasCreate(cublasHandle_t *h)
{
    if (!h) return CUBLAS_STATUS_INVALID_VALUE;
    if (api_enter("cublasCreate")) return CUBLAS_STATUS_NOT_INITIALIZED;
    *h = new cublasContext;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    /* cuBLAS waits for the handle's work; the stream may be gone, so drain the device */
    if (h->stream) cudaStreamSynchronize(h->stream);
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream_get(s)) return CUBLAS_STATUS_INVALID_VALUE;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (bytes && range_kind(ws, bytes, NULL, NULL) != MEM_DEVICE) {
        say("cublasSetWorkspace: [%p, +%zu) is not inside one device allocation", ws, bytes);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t m)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    return m == CUBLAS_POINTER_MODE_HOST ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasSetAtomicsMode(cublasHandle_t h, cublasAtomicsMode_t m)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    return m == CUBLAS_ATOMICS_NOT_ALLOWED || m == CUBLAS_ATOMICS_ALLOWED
               ? CUBLAS_STATUS_SUCCESS
               : CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m)
{
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m != CUBLAS_DEFAULT_MATH && m != CUBLAS_PEDANTIC_MATH && m != CUBLAS_TF32_TENSOR_OP_MATH)
        return CUBLAS_STATUS_INVALID_VALUE;
    h->math = m;
    return CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusString(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "the operation completed successfully";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
    }
    return "unknown error";
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc)
{
    return gemm(h, "cublasSgemm", ta, tb, m, n, k, alpha, Mat{A, CUDA_R_32F, lda, 0}, Mat{B, CUDA_R_32F, ldb, 0},
                beta, C, ldc, 0, 1);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda,
                                         long long sa, const float *B, int ldb, long long sb,
                                         const float *beta, float *C, int ldc, long long sc,
                                         int batch)
{
    if (sa < 0 || sb < 0 || sc < 0) return CUBLAS_STATUS_INVALID_VALUE;
    return gemm(h, "cublasSgemmStridedBatched", ta, tb, m, n, k, alpha,
                Mat{A, CUDA_R_32F, lda, sa}, Mat{B, CUDA_R_32F, ldb, sb}, beta, C, ldc, sc, batch);
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType at,
                            int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                            void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo)
{
    if ((at != CUDA_R_32F && at != CUDA_R_16BF) || bt != at || ct != CUDA_R_32F ||
        (compute != CUBLAS_COMPUTE_32F && compute != CUBLAS_COMPUTE_32F_FAST_TF32) ||
        algo != CUBLAS_GEMM_DEFAULT) {
        say("cublasGemmEx: types %d/%d/%d, compute %d, algo %d not emulated", at, bt, ct,
            compute, algo);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return gemm(h, "cublasGemmEx", ta, tb, m, n, k, alpha, Mat{A, at, lda, 0}, Mat{B, bt, ldb, 0},
                beta, (float *)C, ldc, 0, 1);
}

} /* extern "C" */

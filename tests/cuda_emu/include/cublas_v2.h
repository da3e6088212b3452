/* cublas_v2.h of the CUDA emulator (tests/cuda_emu/): the cuBLAS calls of kernels/cuda/,
 * run on the handle's stream as the cuBLAS 13 reference describes them (column-major,
 * C = alpha op(A) op(B) + beta C, C not read when beta is 0).
 *
 * Argument errors (a negative size, a leading dimension below the rows of its matrix, an
 * unsupported type) return CUBLAS_STATUS_INVALID_VALUE or _NOT_SUPPORTED at once. When the
 * call runs, every matrix must lie inside one live device allocation, and alpha and beta in
 * host memory (pointer mode host, the only one emulated); otherwise it is a sticky fault
 * (cudaErrorIllegalAddress) as on a GPU. Sums are in fp32, in a fixed order of eight
 * interleaved partial sums along k: deterministic, not cuBLAS's order.
 */
#ifndef CUDA_EMU_CUBLAS_V2_H
#define CUDA_EMU_CUBLAS_V2_H

#include "cuda_runtime_api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;
typedef enum { CUBLAS_POINTER_MODE_HOST = 0, CUBLAS_POINTER_MODE_DEVICE = 1 } cublasPointerMode_t;
typedef enum { CUBLAS_ATOMICS_NOT_ALLOWED = 0, CUBLAS_ATOMICS_ALLOWED = 1 } cublasAtomicsMode_t;
typedef enum {
    CUBLAS_DEFAULT_MATH = 0,
    CUBLAS_PEDANTIC_MATH = 2,
    CUBLAS_TF32_TENSOR_OP_MATH = 3
} cublasMath_t;
typedef enum { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 } cudaDataType;
typedef cudaDataType cudaDataType_t;
typedef enum { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 } cublasComputeType_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;
typedef struct cublasContext *cublasHandle_t;

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSetWorkspace(cublasHandle_t h, void *ws, size_t bytes);
cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t m);
cublasStatus_t cublasSetAtomicsMode(cublasHandle_t h, cublasAtomicsMode_t m);
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m);
const char *cublasGetStatusString(cublasStatus_t s);

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc);
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta,
                                         cublasOperation_t tb, int m, int n, int k,
                                         const float *alpha, const float *A, int lda,
                                         long long sa, const float *B, int ldb, long long sb,
                                         const float *beta, float *C, int ldc, long long sc,
                                         int batch);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                            int n, int k, const void *alpha, const void *A, cudaDataType at,
                            int lda, const void *B, cudaDataType bt, int ldb, const void *beta,
                            void *C, cudaDataType ct, int ldc, cublasComputeType_t compute,
                            cublasGemmAlgo_t algo);

#ifdef __cplusplus
}
#endif

#endif /* CUDA_EMU_CUBLAS_V2_H */

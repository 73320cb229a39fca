// Does a CUDA stream wait on a page-locked host word hold the work queued behind it until the host stores the
// word, as arcsplit's patch 0009 (ggml_backend_wait_host_u32) and the rpc-server's gated sets rely on? A check of
// the primitive alone, seconds long, for a lent GPU before the ~350 s build that uses it.
//
//   nvcc -O2 -std=c++17 -o wait_host_word bench/gpu/wait_host_word.cu -lcuda && ./wait_host_word [rounds]
//
// Per round, as the rpc-server does: wait(word >= n) and the copy of a page-locked slot to the device are queued on
// a non-blocking stream; then a CUDA graph is captured and launched behind them on the same stream (ggml-cuda
// captures its graph with the wait still pending); the stream must not have run 2 ms later; the host writes the
// slot, stores the word, and the slot's value must come back. Prints the delay from the store to the stream's end
// (min / median / max, us). Exit 0 when every round held and returned the new value; 1 otherwise.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#define CHECK(x)                                                                              \
    do {                                                                                      \
        auto err_ = (x);                                                                      \
        if ((int) err_ != 0) {                                                                \
            std::fprintf(stderr, "wait_host_word: %s failed (%d) at line %d\n", #x, (int) err_, __LINE__); \
            return 1;                                                                         \
        }                                                                                     \
    } while (0)

int main(int argc, char ** argv) {
    const int rounds = argc > 1 ? std::atoi(argv[1]) : 200;
    const size_t n = 1024;  // floats: a 4 KiB activation
    CHECK(cudaSetDevice(0));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    uint32_t * word = nullptr;
    float * slot = nullptr;
    float * back = nullptr;
    float * dev = nullptr;
    float * dev2 = nullptr;
    CHECK(cudaMallocHost((void **) &word, 64));  // what ggml-cuda's host buffer type allocates
    CHECK(cudaMallocHost((void **) &slot, n * sizeof(float)));
    CHECK(cudaMallocHost((void **) &back, n * sizeof(float)));
    CHECK(cudaMalloc((void **) &dev, n * sizeof(float)));
    CHECK(cudaMalloc((void **) &dev2, n * sizeof(float)));
    __atomic_store_n(word, 0u, __ATOMIC_RELEASE);
    void * dev_word = nullptr;
    CHECK(cudaHostGetDevicePointer(&dev_word, word, 0));

    std::vector<double> us;
    int held = 0, right = 0;
    for (int i = 1; i <= rounds; i++) {
        slot[0] = -1.0f;  // stale: what the device would copy if it did not wait
        CHECK(cuStreamWaitValue32(stream, (CUdeviceptr) dev_word, (uint32_t) i, CU_STREAM_WAIT_VALUE_GEQ));
        CHECK(cudaMemcpyAsync(dev, slot, n * sizeof(float), cudaMemcpyHostToDevice, stream));
        // the graph behind the wait, captured while the wait is pending (as ggml-cuda's graph_compute does)
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
        CHECK(cudaMemcpyAsync(dev2, dev, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
        CHECK(cudaStreamEndCapture(stream, &graph));
        CHECK(cudaGraphInstantiate(&exec, graph, nullptr, nullptr, 0));
        CHECK(cudaGraphLaunch(exec, stream));
        CHECK(cudaMemcpyAsync(back, dev2, n * sizeof(float), cudaMemcpyDeviceToHost, stream));
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        const cudaError_t q = cudaStreamQuery(stream);
        held += q == cudaErrorNotReady;
        if (q != cudaErrorNotReady && q != cudaSuccess) {
            CHECK(q);
        }
        slot[0] = (float) i;
        const auto t0 = std::chrono::steady_clock::now();
        __atomic_store_n(word, (uint32_t) i, __ATOMIC_RELEASE);
        CHECK(cudaStreamSynchronize(stream));
        const auto t1 = std::chrono::steady_clock::now();
        us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        right += back[0] == (float) i;
        CHECK(cudaGraphExecDestroy(exec));
        CHECK(cudaGraphDestroy(graph));
    }
    std::sort(us.begin(), us.end());
    std::printf("wait_host_word: %d rounds; the stream held until the store in %d, the new value came back in %d; "
                "store -> stream done: %.1f / %.1f / %.1f us (min / median / max)\n",
                rounds, held, right, us.front(), us[us.size() / 2], us.back());
    return held == rounds && right == rounds ? 0 : 1;
}

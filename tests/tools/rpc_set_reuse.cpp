// A client of a real rpc-server for tests/test_patches.py (patch 0014): sets one tensor of BYTES from host memory,
// overwrites that memory the moment the set returns, reads the tensor back and compares it with what was set.
// WAY: "compute" (a buffer marked as llama.cpp's compute buffers are: an input llama-server uploads on every
// ubatch), "weights" (a buffer as the model's weights are loaded into: a synchronous set) or "async" (the backend's
// set_tensor_async, then a synchronize). Prints "same" or "changed", then the largest block the client allocated
// with C++'s operator new while the set ran, in bytes (a copy of the data on the client's side is one such block;
// this file replaces the global operator new, which the RPC library's allocations resolve to). READ_PIECE, when
// given, reads the tensor back in gets of that many bytes (an rpc-server replies to a get above 64 MiB from a block
// of its whole size: tests that watch the server's memory read back in pieces).
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-rpc.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

static std::atomic<bool>   counting{false};
static std::atomic<size_t> largest{0};

static void * counted(size_t n) {
    if (counting.load()) {
        size_t seen = largest.load();
        while (n > seen && !largest.compare_exchange_weak(seen, n)) {
        }
    }
    void * p = std::malloc(n ? n : 1);
    if (p == nullptr) {
        throw std::bad_alloc();
    }
    return p;
}

void * operator new(size_t n) { return counted(n); }
void * operator new[](size_t n) { return counted(n); }
void operator delete(void * p) noexcept { std::free(p); }
void operator delete[](void * p) noexcept { std::free(p); }
void operator delete(void * p, size_t) noexcept { std::free(p); }
void operator delete[](void * p, size_t) noexcept { std::free(p); }

int main(int argc, char ** argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: rpc_set_reuse HOST:PORT BYTES compute|weights|async [READ_PIECE]\n");
        return 2;
    }
    const char * endpoint = argv[1];
    const size_t bytes    = std::strtoull(argv[2], nullptr, 10);
    const std::string way = argv[3];
    const size_t piece    = argc == 5 ? std::strtoull(argv[4], nullptr, 10) : bytes;
    ggml_backend_t backend = ggml_backend_rpc_init(endpoint, 0);
    if (backend == nullptr) {
        fprintf(stderr, "no rpc-server at %s\n", endpoint);
        return 1;
    }
    ggml_init_params params = { 2 * ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * t = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) bytes);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (buf == nullptr) {
        fprintf(stderr, "could not allocate %zu bytes on the rpc-server\n", bytes);
        return 1;
    }
    ggml_backend_buffer_set_usage(buf, way == "weights" ? GGML_BACKEND_BUFFER_USAGE_WEIGHTS
                                                        : GGML_BACKEND_BUFFER_USAGE_COMPUTE);
    std::vector<uint8_t> data(bytes), want(bytes), back(bytes);
    for (size_t i = 0; i < bytes; i++) {
        data[i] = want[i] = (uint8_t) (i * 7 + 1);
    }
    counting = true;
    if (way == "async") {
        ggml_backend_tensor_set_async(backend, t, data.data(), 0, bytes);
    } else {
        ggml_backend_tensor_set(t, data.data(), 0, bytes);
    }
    counting = false;
    memset(data.data(), 0xA5, bytes);  // the caller's memory is its own again: this must not reach the tensor
    ggml_backend_synchronize(backend);
    for (size_t done = 0; done < bytes; done += piece) {
        ggml_backend_tensor_get(t, back.data() + done, done, std::min(piece, bytes - done));
    }
    printf("%s %zu\n", back == want ? "same" : "changed", largest.load());
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    ggml_backend_free(backend);
    return 0;
}

// One RPC link, timed from the client's side (bench/rpc_link.py builds and runs it against a real rpc-server):
// a bulk upload (SET_TENSOR of N bytes, then a 4-byte GET so the upload has landed), a bulk download (GET of N
// bytes) and a small round trip (GET of 4 bytes). Where this process has a GPU of its own (the build's backend),
// also a device upload: a copy of N bytes from a tensor on that GPU into the rpc-server's buffer (what a hybrid
// split does with each activation: read the card, send the bytes), then a 4-byte GET. Prints one line per
// repetition: op bytes microseconds.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-rpc.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

static double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char ** argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: rpc_link HOST:PORT BYTES REPS\n");
        return 2;
    }
    const char * endpoint = argv[1];
    const size_t bytes    = std::strtoull(argv[2], nullptr, 10);
    const int    reps     = std::atoi(argv[3]);
    ggml_backend_buffer_type_t buft = ggml_backend_rpc_buffer_type(endpoint, 0);
    if (buft == nullptr) {
        fprintf(stderr, "no rpc-server at %s\n", endpoint);
        return 1;
    }
    ggml_init_params params = { 4 * ggml_tensor_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(params);
    ggml_tensor * big   = ggml_new_tensor_1d(ctx, GGML_TYPE_I8, (int64_t) bytes);
    ggml_tensor * small = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    if (buf == nullptr) {
        fprintf(stderr, "could not allocate %zu bytes on the rpc-server\n", bytes);
        return 1;
    }
    // what the scheduler's activations live in: patch 0001 queues uploads into these instead of waiting
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_COMPUTE);
    std::vector<char> host(bytes, 1);
    // the client's own GPU, if the build has one: the source of a hybrid split's activations
    ggml_backend_load_all();
    ggml_backend_dev_t gpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_GPU);
    ggml_context * lctx = nullptr;
    ggml_tensor * local = nullptr;
    ggml_backend_buffer_t lbuf = nullptr;
    if (gpu != nullptr) {
        lctx = ggml_init(params);
        local = ggml_new_tensor_1d(lctx, GGML_TYPE_I8, (int64_t) bytes);
        lbuf = ggml_backend_alloc_ctx_tensors_from_buft(lctx, ggml_backend_dev_buffer_type(gpu));
        if (lbuf == nullptr) {
            fprintf(stderr, "could not allocate %zu bytes on %s\n", bytes, ggml_backend_dev_name(gpu));
            return 1;
        }
        ggml_backend_tensor_set(local, host.data(), 0, bytes);
    }
    float f = 0.0f;
    for (int r = -2; r < reps; r++) {  // two warm-up rounds
        double t0 = now_us();
        ggml_backend_tensor_set(big, host.data(), 0, bytes);
        ggml_backend_tensor_get(small, &f, 0, sizeof(f));
        double t1 = now_us();
        ggml_backend_tensor_get(big, host.data(), 0, bytes);
        double t2 = now_us();
        ggml_backend_tensor_get(small, &f, 0, sizeof(f));
        double t3 = now_us();
        if (r >= 0) {
            printf("upload %zu %.1f\ndownload %zu %.1f\nround_trip 4 %.1f\n", bytes, t1 - t0, bytes, t2 - t1, t3 - t2);
        }
        if (local != nullptr) {
            double t4 = now_us();
            ggml_backend_tensor_copy(local, big);
            ggml_backend_tensor_get(small, &f, 0, sizeof(f));
            double t5 = now_us();
            if (r >= 0) {
                printf("device_upload %zu %.1f\n", bytes, t5 - t4);
            }
        }
    }
    if (lbuf != nullptr) {
        ggml_backend_buffer_free(lbuf);
        ggml_free(lctx);
    }
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return 0;
}

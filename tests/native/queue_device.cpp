// A test device for ggml-rpc's gated sets (arcsplit patches 0001, 0003, 0007, 0009), for machines without a GPU.
//
// An rpc-server takes gated sets' device-side path only where its one device offers ggml_backend_wait_host_u32 (patch
// 0009 offers it on CUDA). This library, LD_PRELOADed into ggml-rpc-server, registers one more device, "QUEUE": an
// in-order queue on a host thread in front of the CPU backend, with the semantics of a CUDA stream that path relies
// on: set_tensor_async / get_tensor_async copy when the queue reaches them (so a copy queued behind a wait reads its
// page-locked slot after the host stored the word), graph_compute is queued, synchronize drains, and the wait holds
// the queue until the word is at least the value (cyclically, as cuStreamWaitValue32's GEQ). The device's type is
// GPU, so the rpc-server picks it when no -d is given. It registers itself only in a process named ggml-rpc-server,
// so llama-server in the same environment is untouched, unless ARCSPLIT_TEST_QUEUE_PROCS names other processes
// (comma-separated). It has events, so llama-server can hold it as its own card; ARCSPLIT_TEST_QUEUE_REG_NAME
// renames its registry (CUDA: llama-server's client then reads an activation off it asynchronously, patch 0001,
// which it does only from CUDA and SYCL cards).
//
// ARCSPLIT_TEST_QUEUE_BLOCKING=1: graph_compute returns only when its graph has run, as ggml-cuda's does when a
// MUL_MAT_ID reads its ids back mid-graph (the reason the rpc-server launches a gated graph on another thread).
// ARCSPLIT_TEST_QUEUE_LATE_COPY_US=N: an asynchronous set reads its source N us late (see set_tensor_async).
// ARCSPLIT_TEST_QUEUE_LOG_LAUNCH=1: each graph launch logs the launching thread's id.
// A wait that had to wait says so on stderr ("QUEUE: waited for the host word"); one still open after 60 s aborts
// the process with one line, so a deadlock fails a test instead of hanging it.
//
// Not part of arcsplit or of its patches; tests/test_gates_device.py builds it against the managed build.

#include "ggml-backend-impl.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cerrno>  // program_invocation_short_name (GNU)
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include <sys/syscall.h>
#include <unistd.h>

namespace {

class queue {
  public:
    queue() : worker([this] { run(); }) {}
    ~queue() {
        {
            std::lock_guard<std::mutex> lock(m);
            stop = true;
        }
        more.notify_all();
        worker.join();
    }
    void push(std::function<void()> task) {
        {
            std::lock_guard<std::mutex> lock(m);
            tasks.push_back(std::move(task));
        }
        more.notify_one();
    }
    void drain() {
        std::unique_lock<std::mutex> lock(m);
        idle.wait(lock, [this] { return tasks.empty() && !busy; });
    }

  private:
    void run() {
        for (;;) {
            std::function<void()> task;
            {
                std::unique_lock<std::mutex> lock(m);
                more.wait(lock, [this] { return stop || !tasks.empty(); });
                if (tasks.empty()) {
                    return;
                }
                task = std::move(tasks.front());
                tasks.pop_front();
                busy = true;
            }
            task();
            {
                std::lock_guard<std::mutex> lock(m);
                busy = false;
            }
            idle.notify_all();
        }
    }
    std::mutex m;
    std::condition_variable more, idle;
    std::deque<std::function<void()>> tasks;
    bool busy = false;
    bool stop = false;
    std::thread worker;  // last: started once the members it uses exist
};

struct queue_context {
    ggml_backend_t cpu;
    bool blocking;
    queue q;
};

// an event: each record is numbered, and passes when the queue it was recorded on reaches it
struct queue_event {
    std::mutex m;
    std::condition_variable cv;
    uint64_t recorded = 0;
    uint64_t passed = 0;
    void pass(uint64_t n) {
        {
            std::lock_guard<std::mutex> lock(m);
            passed = std::max(passed, n);
        }
        cv.notify_all();
    }
    void wait(uint64_t n) {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return passed >= n; });
    }
    uint64_t last() {
        std::lock_guard<std::mutex> lock(m);
        return recorded;
    }
};

ggml_backend_dev_t cpu_device() {
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
}

const char * backend_name(ggml_backend_t) {
    return "QUEUE";
}

void backend_free(ggml_backend_t backend) {
    auto * ctx = (queue_context *)backend->context;
    ctx->q.drain();
    ggml_backend_t cpu = ctx->cpu;
    delete ctx;
    ggml_backend_free(cpu);
    delete backend;
}

// ARCSPLIT_TEST_QUEUE_LATE_COPY_US=N: an asynchronous set reads its source N us after the queue reaches it, so a
// caller that reuses that source before synchronizing (as a CUDA copy from page-locked memory would punish) copies
// the newer bytes
int late_copy_us() {
    static const int us = [] {
        const char * v = getenv("ARCSPLIT_TEST_QUEUE_LATE_COPY_US");
        return v != nullptr ? atoi(v) : 0;
    }();
    return us;
}

// the destination is taken now: the tensor passed may be gone (freed with its context) by the time the copy runs
void set_tensor_async(ggml_backend_t backend, ggml_tensor * tensor, const void * data, size_t offset, size_t size) {
    char * dst = (char *)tensor->data + offset;
    const int late = late_copy_us();
    ((queue_context *)backend->context)->q.push([dst, data, size, late] {
        if (late > 0) {
            std::this_thread::sleep_for(std::chrono::microseconds(late));
        }
        memcpy(dst, data, size);
    });
}

void get_tensor_async(ggml_backend_t backend, const ggml_tensor * tensor, void * data, size_t offset, size_t size) {
    const char * src = (const char *)tensor->data + offset;
    ((queue_context *)backend->context)->q.push([src, data, size] { memcpy(data, src, size); });
}

void synchronize(ggml_backend_t backend) {
    ((queue_context *)backend->context)->q.drain();
}

// ARCSPLIT_TEST_QUEUE_LOG_LAUNCH=1: every graph_compute says on stderr which thread launched it
bool log_launch() {
    static const bool on = [] {
        const char * v = getenv("ARCSPLIT_TEST_QUEUE_LOG_LAUNCH");
        return v != nullptr && strcmp(v, "1") == 0;
    }();
    return on;
}

ggml_status graph_compute(ggml_backend_t backend, ggml_cgraph * graph) {
    auto * ctx = (queue_context *)backend->context;
    ggml_backend_t cpu = ctx->cpu;
    if (log_launch()) {
        fprintf(stderr, "QUEUE: graph launched on thread %ld\n", (long)syscall(SYS_gettid));
    }
    ctx->q.push([cpu, graph] {
        if (ggml_backend_graph_compute(cpu, graph) != GGML_STATUS_SUCCESS) {
            fprintf(stderr, "QUEUE: a graph failed on the CPU backend\n");
            abort();
        }
    });
    if (ctx->blocking) {
        ctx->q.drain();
    }
    return GGML_STATUS_SUCCESS;
}

void event_record(ggml_backend_t backend, ggml_backend_event_t event) {
    auto * ev = (queue_event *)event->context;
    uint64_t n;
    {
        std::lock_guard<std::mutex> lock(ev->m);
        n = ++ev->recorded;
    }
    ((queue_context *)backend->context)->q.push([ev, n] { ev->pass(n); });
}

// the backend's queue waits for the event's last record (which may be on another queue)
void event_wait(ggml_backend_t backend, ggml_backend_event_t event) {
    auto * ev = (queue_event *)event->context;
    const uint64_t n = ev->last();
    ((queue_context *)backend->context)->q.push([ev, n] { ev->wait(n); });
}

const ggml_backend_i backend_iface = {
    /* .get_name            = */ backend_name,
    /* .free                = */ backend_free,
    /* .set_tensor_async    = */ set_tensor_async,
    /* .get_tensor_async    = */ get_tensor_async,
    /* .set_tensor_2d_async = */ nullptr,
    /* .get_tensor_2d_async = */ nullptr,
    /* .cpy_tensor_async    = */ nullptr,
    /* .synchronize         = */ synchronize,
    /* .graph_plan_create   = */ nullptr,
    /* .graph_plan_free     = */ nullptr,
    /* .graph_plan_update   = */ nullptr,
    /* .graph_plan_compute  = */ nullptr,
    /* .graph_compute       = */ graph_compute,
    /* .event_record        = */ event_record,
    /* .event_wait          = */ event_wait,
    /* .graph_optimize      = */ nullptr,
};

ggml_guid queue_guid = {0x61, 0x72, 0x63, 0x73, 0x70, 0x6c, 0x69, 0x74, 0x2d, 0x71, 0x75, 0x65, 0x75, 0x65, 0x00, 0x01};

// ggml_backend_wait_host_u32, as patch 0009 declares it: the queue's next work waits until *word >= value
bool wait_host_u32(ggml_backend_t backend, const volatile uint32_t * word, uint32_t value) {
    ((queue_context *)backend->context)->q.push([word, value] {
        const auto t0 = std::chrono::steady_clock::now();
        bool waited = false;
        while ((int32_t)(__atomic_load_n(word, __ATOMIC_ACQUIRE) - value) < 0) {
            if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(60)) {
                fprintf(stderr, "QUEUE: a wait for the host word (value %u) still open after 60 s\n", value);
                abort();
            }
            waited = true;
            std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
        if (waited) {  // the queue reached the wait before the data: what was queued behind it waited for the data
            fprintf(stderr, "QUEUE: waited for the host word (value %u)\n", value);
        }
    });
    return true;
}

void set_n_threads(ggml_backend_t backend, int n_threads) {
    ggml_backend_cpu_set_n_threads(((queue_context *)backend->context)->cpu, n_threads);
}

const char * dev_name(ggml_backend_dev_t) {
    return "QUEUE";
}

const char * dev_description(ggml_backend_dev_t) {
    return "host-thread queue in front of the CPU backend (arcsplit gated-set tests)";
}

void dev_memory(ggml_backend_dev_t, size_t * free, size_t * total) {
    ggml_backend_dev_memory(cpu_device(), free, total);
}

enum ggml_backend_dev_type dev_type(ggml_backend_dev_t) {
    return GGML_BACKEND_DEVICE_TYPE_GPU;
}

void dev_props(ggml_backend_dev_t dev, ggml_backend_dev_props * props) {
    ggml_backend_dev_get_props(cpu_device(), props);
    props->name = dev_name(dev);
    props->description = dev_description(dev);
    props->type = GGML_BACKEND_DEVICE_TYPE_GPU;
    props->device_id = nullptr;
    props->caps.async = true;
    props->caps.host_buffer = true;
    props->caps.buffer_from_host_ptr = false;
    props->caps.events = true;
}

ggml_backend_t dev_init(ggml_backend_dev_t dev, const char *) {
    ggml_backend_t cpu = ggml_backend_cpu_init();
    if (cpu == nullptr) {
        return nullptr;
    }
    const char * blocking = getenv("ARCSPLIT_TEST_QUEUE_BLOCKING");
    auto * ctx = new queue_context{cpu, blocking != nullptr && strcmp(blocking, "1") == 0, {}};
    return new ggml_backend{&queue_guid, backend_iface, dev, ctx};
}

// the CPU backend's buffer type, as this device's own (its device pointer is this device: a client reading off it
// finds the device, and the device's host buffer type, from the buffer)
ggml_backend_buffer_type queue_buft;

ggml_backend_buffer_type_t dev_buffer_type(ggml_backend_dev_t) {
    return &queue_buft;
}

bool dev_supports_op(ggml_backend_dev_t, const ggml_tensor * op) {
    return ggml_backend_dev_supports_op(cpu_device(), op);
}

bool dev_supports_buft(ggml_backend_dev_t, ggml_backend_buffer_type_t buft) {
    return ggml_backend_buft_is_host(buft);
}

bool dev_offload_op(ggml_backend_dev_t, const ggml_tensor *) {
    return false;
}

ggml_backend_event_t event_new(ggml_backend_dev_t dev) {
    return new ggml_backend_event{dev, new queue_event};
}

void event_free(ggml_backend_dev_t, ggml_backend_event_t event) {
    delete (queue_event *)event->context;
    delete event;
}

void event_synchronize(ggml_backend_dev_t, ggml_backend_event_t event) {
    auto * ev = (queue_event *)event->context;
    ev->wait(ev->last());
}

ggml_backend_device_i device_iface = {
    /* .get_name             = */ dev_name,
    /* .get_description      = */ dev_description,
    /* .get_memory           = */ dev_memory,
    /* .get_type             = */ dev_type,
    /* .get_props            = */ dev_props,
    /* .init_backend         = */ dev_init,
    /* .get_buffer_type      = */ dev_buffer_type,
    /* .get_host_buffer_type = */ dev_buffer_type,  // host memory stands for page-locked memory here
    /* .buffer_from_host_ptr = */ nullptr,
    /* .supports_op          = */ dev_supports_op,
    /* .supports_buft        = */ dev_supports_buft,
    /* .offload_op           = */ dev_offload_op,
    /* .event_new            = */ event_new,
    /* .event_free           = */ event_free,
    /* .event_synchronize    = */ event_synchronize,
};

ggml_backend_reg queue_reg_storage;
ggml_backend_device queue_device = {device_iface, &queue_reg_storage, nullptr};

const char * reg_name(ggml_backend_reg_t) {
    const char * name = getenv("ARCSPLIT_TEST_QUEUE_REG_NAME");
    return name != nullptr && name[0] != '\0' ? name : "QUEUE";
}

size_t reg_device_count(ggml_backend_reg_t) {
    return 1;
}

ggml_backend_dev_t reg_device(ggml_backend_reg_t, size_t index) {
    return index == 0 ? &queue_device : nullptr;
}

void * reg_proc_address(ggml_backend_reg_t, const char * name) {
    if (strcmp(name, "ggml_backend_wait_host_u32") == 0) {
        return (void *)wait_host_u32;
    }
    if (strcmp(name, "ggml_backend_set_n_threads") == 0) {
        return (void *)set_n_threads;
    }
    return nullptr;
}

// whether this process is one the device registers in: ggml-rpc-server, or one ARCSPLIT_TEST_QUEUE_PROCS names
bool wanted_here() {
    const char * procs = getenv("ARCSPLIT_TEST_QUEUE_PROCS");
    std::string list = procs != nullptr ? procs : "ggml-rpc-server";
    size_t start = 0;
    while (start <= list.size()) {
        const size_t end = std::min(list.find(',', start), list.size());
        if (list.compare(start, end - start, program_invocation_short_name) == 0) {
            return true;
        }
        start = end + 1;
    }
    return false;
}

__attribute__((constructor)) void register_queue_device() {
    if (!wanted_here()) {
        return;
    }
    queue_buft = *ggml_backend_cpu_buffer_type();
    queue_buft.device = &queue_device;
    queue_reg_storage = {GGML_BACKEND_API_VERSION, {reg_name, reg_device_count, reg_device, reg_proc_address}, nullptr};
    ggml_backend_register(&queue_reg_storage);
}

}  // namespace

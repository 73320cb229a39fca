// A CUPTI activity tracer loaded into every CUDA process of a group (CUDA_INJECTION64_PATH), for
// bench/gpu_trace.py: the GPU timeline of llama-server and its rpc-servers on one card, in one clock.
//
// Nsight Systems is not on the lent machines; CUPTI (in every CUDA toolkit) is. The CUDA driver calls
// InitializeInjection() in each process that sets CUDA_INJECTION64_PATH to this library, before its first
// CUDA call. Records: kernels (K), memcpys (M), memsets (S) and CUDA runtime calls (R), each with start and end
// in CUPTI's timestamp (ns, one clock for every process of the machine), written as tab-separated lines to
// $ARCSPLIT_CUPTI_DIR/<pid>.tsv. A thread flushes the buffers every 100 ms, so a process killed by a signal (an
// rpc-server has no handler) loses at most its last 100 ms.
//
// Build: cc -O2 -shared -fPIC -I$CUDA/include -I$CUDA/extras/CUPTI/include bench/gpu/cupti_trace.c
//           -L$CUDA/extras/CUPTI/lib64 -lcupti -Wl,-rpath,$CUDA/extras/CUPTI/lib64 -o libcupti_trace.so
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>

#define BUF_SIZE (8u << 20)

static FILE *out;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = (uint8_t *) aligned_alloc(8, BUF_SIZE);
    *size = BUF_SIZE;
    *max_records = 0;
}

static const char *runtime_name(uint32_t cbid) {
    const char *name = NULL;
    if (cuptiGetCallbackName(CUPTI_CB_DOMAIN_RUNTIME_API, cbid, &name) != CUPTI_SUCCESS || name == NULL) {
        return "?";
    }
    return name;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void) ctx; (void) stream; (void) size;
    CUpti_Activity *rec = NULL;
    pthread_mutex_lock(&lock);
    while (out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
        case CUPTI_ACTIVITY_KIND_KERNEL: {
            CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *) rec;
            fprintf(out, "K\t%llu\t%llu\t%u\t%u\t%s\n", (unsigned long long) k->start, (unsigned long long) k->end,
                    k->streamId, k->graphId, k->name ? k->name : "?");
            break;
        }
        case CUPTI_ACTIVITY_KIND_GRAPH_TRACE: {  // light mode: one record per CUDA graph launch
            CUpti_ActivityGraphTrace2 *g = (CUpti_ActivityGraphTrace2 *) rec;
            fprintf(out, "K\t%llu\t%llu\t%u\t%u\t(cuda graph)\n", (unsigned long long) g->start,
                    (unsigned long long) g->end, g->streamId, g->graphId);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
            CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *) rec;
            fprintf(out, "M\t%llu\t%llu\t%u\t%llu\t%u\n", (unsigned long long) m->start, (unsigned long long) m->end,
                    m->streamId, (unsigned long long) m->bytes, (unsigned) m->copyKind);
            break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
            CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *) rec;
            fprintf(out, "S\t%llu\t%llu\t%u\t%llu\n", (unsigned long long) m->start, (unsigned long long) m->end,
                    m->streamId, (unsigned long long) m->bytes);
            break;
        }
        case CUPTI_ACTIVITY_KIND_RUNTIME: {
            CUpti_ActivityAPI *a = (CUpti_ActivityAPI *) rec;
            fprintf(out, "R\t%llu\t%llu\t%u\t%s\n", (unsigned long long) a->start, (unsigned long long) a->end,
                    a->threadId, runtime_name(a->cbid));
            break;
        }
        default:
            break;
        }
    }
    if (out) {
        fflush(out);
    }
    pthread_mutex_unlock(&lock);
    free(buffer);
}

// CUPTI's own flush period hands over only full buffers; an rpc-server idles in a socket read and is killed
// by a signal, so a thread forces a flush every 100 ms.
static void *flusher(void *arg) {
    (void) arg;
    for (;;) {
        usleep(100000);
        cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    }
    return NULL;
}

static void at_exit(void) {
    cuptiActivityFlushAll(1);
}

int InitializeInjection(void) {
    const char *dir = getenv("ARCSPLIT_CUPTI_DIR");
    if (dir == NULL || *dir == '\0') {
        return 1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%d.tsv", dir, (int) getpid());
    out = fopen(path, "w");
    if (out == NULL) {
        return 1;
    }
    cuptiActivityRegisterCallbacks(requested, completed);
    // ARCSPLIT_CUPTI_LIGHT=1: a CUDA graph is one record (start of its first node to end of its last) instead of
    // one per kernel, which costs the traced process far less; kernels launched outside graphs are then not seen.
    const char *light = getenv("ARCSPLIT_CUPTI_LIGHT");
    cuptiActivityEnable(light && *light == '1' ? CUPTI_ACTIVITY_KIND_GRAPH_TRACE : CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME);
    pthread_t t;
    pthread_create(&t, NULL, flusher, NULL);
    pthread_detach(t);
    atexit(at_exit);
    return 1;
}

// A stand-in for libcupti's activity API, for testing package cupti without
// a GPU: fake_emit hands CUPTI-style kernel records to the registered
// callbacks from a thread of its own, as CUPTI's worker thread does.
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RECORD 176  // bytes a record takes, more than the 160 package cupti reads

typedef void (*requested_fn)(uint8_t**, size_t*, size_t*);
typedef void (*completed_fn)(void*, uint32_t, uint8_t*, size_t, size_t);

static requested_fn requested;
static completed_fn completed;
static int enabled;
static uint8_t* pending;
static size_t pending_size, pending_valid;
static uint64_t clock_ns = 1000;
static size_t drop;
static const char* names[2] = {"_Z3fooILi1EEvv", "plain_kernel"};

int cuptiActivityRegisterCallbacks(requested_fn r, completed_fn c) {
  requested = r;
  completed = c;
  return 0;
}
int cuptiActivityEnable(int kind) {
  if (kind != 10) return 21;
  enabled = 1;
  return 0;
}
int cuptiActivityDisable(int kind) {
  enabled = 0;
  return 0;
}
int cuptiActivityFlushAll(uint32_t flag) {
  if (pending) {
    uint8_t* b = pending;
    pending = 0;
    completed(0, 0, b, pending_size, pending_valid);
  }
  return 0;
}
int cuptiActivityGetNextRecord(uint8_t* buf, size_t valid, uint8_t** rec) {
  uint8_t* next = *rec ? *rec + RECORD : buf;
  if (next + RECORD > buf + valid) return 12;
  *rec = next;
  return 0;
}
int cuptiActivityGetNumDroppedRecords(void* ctx, uint32_t stream, size_t* n) {
  *n = drop;
  drop = 0;
  return 0;
}
int cuptiGetTimestamp(uint64_t* t) {
  *t = __atomic_add_fetch(&clock_ns, 1, __ATOMIC_SEQ_CST);
  return 0;
}
int cuptiGetResultString(int r, const char** s) {
  *s = "fake CUPTI error";
  return 0;
}

struct emit {
  int n, complete_now, other_kinds;
};

static void* emit_thread(void* arg) {
  struct emit* e = arg;
  uint8_t* buf;
  size_t size, max;
  requested(&buf, &size, &max);
  if (!buf || size < (size_t)(e->n * 2 + 1) * RECORD) return 0;
  size_t off = 0;
  for (int i = 0; i < e->n; i++) {
    if (e->other_kinds) {  // a memcpy record between kernels: skipped
      memset(buf + off, 0, RECORD);
      *(uint32_t*)(buf + off) = 1;
      off += RECORD;
    }
    uint8_t* r = buf + off;
    memset(r, 0, RECORD);
    uint64_t start = __atomic_add_fetch(&clock_ns, 10, __ATOMIC_SEQ_CST);
    uint64_t end = start + 5 + i;
    *(uint32_t*)(r + 0) = 10;
    *(uint16_t*)(r + 6) = 32;
    memcpy(r + 16, &start, 8);
    memcpy(r + 24, &end, 8);
    *(uint32_t*)(r + 48) = 7;
    *(int32_t*)(r + 52) = 132;
    *(int32_t*)(r + 64) = 256;
    *(uint32_t*)(r + 92) = 1000 + i;
    const char* name = names[i % 2];
    memcpy(r + 104, &name, sizeof name);
    *(uint32_t*)(r + 156) = i % 2;
    off += RECORD;
  }
  if (e->complete_now) {
    completed(0, 7, buf, size, off);
  } else {
    pending = buf;
    pending_size = size;
    pending_valid = off;
  }
  return 0;
}

// fake_emit_here does what fake_emit's thread does on the calling thread,
// as CUPTI does inside a CUDA call that needs a buffer.
int fake_emit_here(int n, int complete_now) {
  if (!enabled) return -1;
  struct emit e = {n, complete_now, 0};
  drop = 0;
  emit_thread(&e);
  return 0;
}

// fake_emit writes n kernel records (every other one with a memcpy record
// before it when other_kinds is set) into a buffer it requests from a new
// thread, and completes the buffer there (complete_now) or at the next
// flush; dropped is what the next dropped-records query reports.
int fake_emit(int n, int complete_now, int other_kinds, int dropped) {
  if (!enabled) return -1;
  struct emit e = {n, complete_now, other_kinds};
  drop = (size_t)dropped;
  pthread_t t;
  if (pthread_create(&t, 0, emit_thread, &e)) return -2;
  pthread_join(t, 0);
  return 0;
}

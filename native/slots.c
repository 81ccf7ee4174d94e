/* The shmloader C helper: atomic slot states and the parent-death signal. Kept tiny. */
#include <stdint.h>
#include <stddef.h>
#include <errno.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* Acquire: everything the writer did before its release store is visible after this. */
uint32_t sl_load(uint32_t *states, size_t index) {
    return __atomic_load_n(&states[index], __ATOMIC_ACQUIRE);
}

/* Release: every write this process made before is visible to whoever acquires the value. */
void sl_store(uint32_t *states, size_t index, uint32_t value) {
    __atomic_store_n(&states[index], value, __ATOMIC_RELEASE);
}

/* Returns 1 when states[index] was `expected` and is now `desired`, else 0. */
int sl_cas(uint32_t *states, size_t index, uint32_t expected, uint32_t desired) {
    uint32_t old = expected;
    return __atomic_compare_exchange_n(&states[index], &old, desired, 0,
                                       __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* Claims the first slot at or after `start` (wrapping) whose state is `expected` by
 * moving it to `desired`; returns its index, or -1 when none is. One call instead of a
 * Python loop of sl_cas calls: this runs once per batch. */
int sl_find_and_claim(uint32_t *states, size_t count, size_t start, uint32_t expected,
                      uint32_t desired) {
    for (size_t n = 0; n < count; n++) {
        size_t i = (start + n) % count;
        uint32_t old = expected;
        if (__atomic_load_n(&states[i], __ATOMIC_RELAXED) == expected &&
            __atomic_compare_exchange_n(&states[i], &old, desired, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return (int)i;
    }
    return -1;
}

/* How many of the `count` slots are in state `value` now (relaxed loads: a figure for
 * statistics, never a decision). */
size_t sl_count(uint32_t *states, size_t count, uint32_t value) {
    size_t n = 0;
    for (size_t i = 0; i < count; i++)
        n += __atomic_load_n(&states[i], __ATOMIC_RELAXED) == value;
    return n;
}

/* Asks the kernel to send `signum` to this process when its parent thread exits.
 * Returns 0, or the errno of the failure. */
int sl_set_pdeathsig(int signum) {
    if (prctl(PR_SET_PDEATHSIG, (unsigned long)signum, 0, 0, 0) != 0)
        return errno;
    return 0;
}

/* Maps `size` bytes of `fd` shared and writable; NULL on failure (errno says why).
 * `populate` pre-faults every page now, so the hot path never pays a page fault. */
void *sl_map(int fd, size_t size, int populate) {
    int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
    void *addr = mmap(NULL, size, PROT_READ | PROT_WRITE, flags, fd, 0);
    return addr == MAP_FAILED ? NULL : addr;
}

/* Returns 0, or the errno of the failure. */
int sl_unmap(void *addr, size_t size) {
    return munmap(addr, size) == 0 ? 0 : errno;
}

/* One sendmsg of `len` bytes with `fd` attached. The receiver gets the descriptor with
 * the first of these bytes it reads (the kernel never merges it into an earlier read). */
long sl_send_fd(int sock, const void *buf, size_t len, int fd) {
    char control[CMSG_SPACE(sizeof(int))];
    memset(control, 0, sizeof control);
    struct iovec iov = {(void *)buf, len};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    return n < 0 ? -errno : (long)n;
}

/* One recvmsg of up to `len` bytes. A descriptor that came with them is stored in
 * *fd_out (close-on-exec), else -1. The kernel ends a read right after bytes that carry
 * descriptors, so one read never brings two. */
long sl_recv(int sock, void *buf, size_t len, int *fd_out) {
    char control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {buf, len};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    *fd_out = -1;
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
    if (n < 0)
        return -errno;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            memcpy(fd_out, CMSG_DATA(c), sizeof(int));
    return (long)n;
}

/* --- Single-producer single-consumer queues of int64 records, in shared memory ---------
 *
 * One queue is a control block of three cache lines (`ctl`, uint64 words: ctl[0] the head,
 * advanced by the consumer; ctl[8] the tail, advanced by the producer; ctl[16] the
 * consumer's "sleeping" flag) and a circular array of `cap` int64 words. A record is
 * [n, kind, slot, seq, stamp, payload...] with n its length in words; it may wrap around
 * the end of the array. The producer publishes a record with a release store of the tail
 * (the record's words before it); the consumer acquire-loads the tail, copies the
 * records out and release-stores the head (its copies done before the producer may reuse
 * the words). Head and tail only grow (64 bits never wrap).
 *
 * Sleeping without losing a wake-up. The consumer's "sleeping" word (the first 32 bits
 * of ctl[16], so that a futex can wait on it) is 0 while it is awake, SL_Q_SOCKET while it
 * blocks on its socket (a wake-up is a byte written there) and SL_Q_FUTEX while it waits
 * on the word itself (a wake-up is FUTEX_WAKE, no byte). A consumer that finds the queue
 * empty and wants to block sets the word, full fence, loads the tail again (sl_q_arm). A
 * producer: stores the tail, full fence, loads the word; when set, clears it (exchange:
 * one wake per sleep) and wakes the consumer the way the word says. This is Dekker's
 * pattern: with a full fence between each side's store and its load, at least one side
 * sees the other's store, so either the consumer sees the record and does not sleep, or
 * the producer sees the word and wakes it (or both: one spurious wake-up, harmless). A
 * futex wait gives the same guarantee at the last step: the kernel sleeps only while the
 * word still holds SL_Q_FUTEX, so a producer's clear that came first makes it return. */

#define SL_Q_HEAD 0
#define SL_Q_TAIL 8
#define SL_Q_SLEEPING 16
#define SL_Q_SOCKET 1
#define SL_Q_FUTEX 2
#define SL_Q_WOKEN_AT 17 /* in the sleeping word's cache line */
#define SL_Q_FRAMES 18

/* The sleeping word: the first 32 bits of ctl[16] (a futex word is 32 bits; the rest of
 * that cache line is unused). Every access to it goes through this pointer. */
static inline uint32_t *sl_q_word(uint64_t *ctl) {
    return (uint32_t *)&ctl[SL_Q_SLEEPING];
}

/* 1 where this build can sleep on a word of shared memory (Linux futexes), else 0. */
int sl_has_futex(void) {
#ifdef __linux__
    return 1;
#else
    return 0;
#endif
}

/* Sleeps while *word == expected, for up to timeout_ns (< 0: no limit). A shared futex
 * (no FUTEX_PRIVATE_FLAG): the word is in a mapping shared between processes. Returns 0
 * when woken (or woken for no reason: the caller looks again), 1 at the timeout, 2 when
 * the word did not hold `expected` (nothing to wait for), 3 when a signal interrupted it
 * (the caller returns to Python so that its handlers run), -errno on another failure. */
int sl_futex_wait(uint32_t *word, uint32_t expected, int64_t timeout_ns) {
#ifdef __linux__
    struct timespec ts, *tsp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = (time_t)(timeout_ns / 1000000000);
        ts.tv_nsec = (long)(timeout_ns % 1000000000);
        tsp = &ts;
    }
    if (syscall(SYS_futex, word, FUTEX_WAIT, expected, tsp, NULL, 0) == 0)
        return 0;
    switch (errno) {
    case ETIMEDOUT: return 1;
    case EAGAIN: return 2;
    case EINTR: return 3;
    default: return -errno;
    }
#else
    (void)word; (void)expected; (void)timeout_ns;
    return -ENOSYS;
#endif
}

/* Wakes up to n processes sleeping on `word`; returns how many woke, or -errno. */
int sl_futex_wake(uint32_t *word, int n) {
#ifdef __linux__
    long woke = syscall(SYS_futex, word, FUTEX_WAKE, n, NULL, NULL, 0);
    return woke < 0 ? -errno : (int)woke;
#else
    (void)word; (void)n;
    return -ENOSYS;
#endif
}

/* Clears the sleeping word; returns what it held. A futex sleeper is woken here (one
 * system call, nothing for the caller to write); a socket sleeper is the caller's to
 * wake. */
static inline uint32_t sl_q_clear(uint64_t *ctl) {
    uint32_t *w = sl_q_word(ctl);
    uint32_t was = __atomic_exchange_n(w, 0, __ATOMIC_SEQ_CST);
    if (was == SL_Q_FUTEX) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        __atomic_store_n(&ctl[SL_Q_WOKEN_AT], (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec,
                         __ATOMIC_RELAXED);
        sl_futex_wake(w, 1);
    }
    return was;
}

/* When (CLOCK_MONOTONIC ns) a producer last woke the consumer from its futex: the
 * consumer's delay in running after it says how busy its CPUs are. */
int64_t sl_q_woken_at(uint64_t *ctl) {
    return (int64_t)__atomic_load_n(&ctl[SL_Q_WOKEN_AT], __ATOMIC_RELAXED);
}

/* The frames the producer said it wrote (sl_q_ring); read after sl_q_arm. */
uint64_t sl_q_frames(uint64_t *ctl) {
    return __atomic_load_n(&ctl[SL_Q_FRAMES], __ATOMIC_SEQ_CST);
}

/* Appends the record [5 + words, kind, slot, seq, stamp, payload[0..words)]. Returns 0 when
 * it does not fit now (nothing written), 1 when it was published and the consumer was
 * awake, 2 when it was published and the consumer was asleep: with `wake`, on its socket:
 * the word is cleared and the caller owes it a wake-up byte now; without `wake` (either
 * way of sleeping), the word stays set and the caller wakes it later
 * (sl_q_take_sleeper); 3 (only with `wake`) when it was published and the consumer,
 * asleep on the futex, was woken here. */
int sl_q_push(uint64_t *ctl, int64_t *data, size_t cap, int64_t kind, int64_t slot, int64_t seq,
              int64_t stamp, const char *payload, size_t words, int wake) {
    size_t n = 5 + words;
    uint64_t tail = __atomic_load_n(&ctl[SL_Q_TAIL], __ATOMIC_RELAXED);  /* ours */
    uint64_t head = __atomic_load_n(&ctl[SL_Q_HEAD], __ATOMIC_ACQUIRE);
    if (n > cap - (size_t)(tail - head))
        return 0;
    int64_t rec[5] = {(int64_t)n, kind, slot, seq, stamp};
    for (size_t i = 0; i < 5; i++)
        data[(tail + i) % cap] = rec[i];
    size_t at = (size_t)((tail + 5) % cap);
    size_t first = words < cap - at ? words : cap - at;
    memcpy(&data[at], payload, first * 8);
    memcpy(&data[0], payload + first * 8, (words - first) * 8);
    __atomic_store_n(&ctl[SL_Q_TAIL], tail + n, __ATOMIC_RELEASE);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (!__atomic_load_n(sl_q_word(ctl), __ATOMIC_RELAXED))
        return 1;
    if (!wake)
        return 2;
    uint32_t was = sl_q_clear(ctl);
    return was == SL_Q_SOCKET ? 2 : was == SL_Q_FUTEX ? 3 : 1;
}

/* For a producer that deferred a wake-up (sl_q_push without `wake`): clears the consumer's
 * word, waking a futex sleeper here; returns 1 when it slept on its socket (the caller
 * writes the wake-up byte now), 0 otherwise (woken here, or it woke meanwhile: it looks at
 * the queue before sleeping again). */
int sl_q_take_sleeper(uint64_t *ctl) {
    return sl_q_clear(ctl) == SL_Q_SOCKET ? 1 : 0;
}

/* After frames were written to the consumer's socket, `frames` of them in all since the
 * channel began: the count is published (a consumer about to sleep on the futex compares
 * it with the frames it read: sl_q_frames), then a consumer asleep on the futex, which
 * would not see them, is woken (its word cleared); one asleep on the socket is woken by
 * the frame itself and its word is left alone. The same Dekker pattern as the records':
 * either the consumer sees the count, or this sees its word. Returns 1 when it woke one. */
int sl_q_ring(uint64_t *ctl, uint64_t frames) {
    __atomic_store_n(&ctl[SL_Q_FRAMES], frames, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    uint32_t *w = sl_q_word(ctl);
    uint32_t expected = SL_Q_FUTEX;
    if (!__atomic_compare_exchange_n(w, &expected, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return 0;
    sl_futex_wake(w, 1);
    return 1;
}

/* sl_q_push of a record whose payload is the three words a, b, c (a result and its clocks). */
int sl_q_push3(uint64_t *ctl, int64_t *data, size_t cap, int64_t kind, int64_t slot, int64_t seq,
               int64_t stamp, int64_t a, int64_t b, int64_t c) {
    int64_t payload[3] = {a, b, c};
    return sl_q_push(ctl, data, cap, kind, slot, seq, stamp, (const char *)payload, 3, 1);
}

/* Moves whole records, oldest first, into out[0..out_cap) while they fit; returns the
 * words moved (0: the queue is empty, or its oldest record is longer than out_cap). */
size_t sl_q_pop(uint64_t *ctl, int64_t *data, size_t cap, int64_t *out, size_t out_cap) {
    uint64_t head = __atomic_load_n(&ctl[SL_Q_HEAD], __ATOMIC_RELAXED);  /* ours */
    uint64_t tail = __atomic_load_n(&ctl[SL_Q_TAIL], __ATOMIC_ACQUIRE);
    size_t moved = 0;
    while (head != tail) {
        size_t n = (size_t)data[head % cap];
        if (n < 5 || n > tail - head || moved + n > out_cap)
            break;  /* (n out of range: a corrupt queue; never read past the tail) */
        size_t at = (size_t)(head % cap);
        size_t first = n < cap - at ? n : cap - at;
        memcpy(&out[moved], &data[at], first * 8);
        memcpy(&out[moved + first], &data[0], (n - first) * 8);
        moved += n;
        head += n;
    }
    if (moved)
        __atomic_store_n(&ctl[SL_Q_HEAD], head, __ATOMIC_RELEASE);
    return moved;
}

/* The consumer is about to sleep, `how` (SL_Q_SOCKET or SL_Q_FUTEX): sets its word, then
 * looks at the queue again (see above). Returns 1 when it may block (the producer will
 * wake it), 0 when a record arrived meanwhile (the word is cleared again; a wake-up may
 * still come: harmless). */
int sl_q_arm(uint64_t *ctl, uint32_t how) {
    __atomic_store_n(sl_q_word(ctl), how, __ATOMIC_SEQ_CST);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (__atomic_load_n(&ctl[SL_Q_TAIL], __ATOMIC_ACQUIRE) !=
        __atomic_load_n(&ctl[SL_Q_HEAD], __ATOMIC_RELAXED)) {
        __atomic_store_n(sl_q_word(ctl), 0, __ATOMIC_SEQ_CST);
        return 0;
    }
    return 1;
}

/* After sl_q_arm(ctl, SL_Q_FUTEX) returned 1: sleeps until a producer clears the word
 * (a record, or sl_q_ring after a frame), for up to timeout_ns. First it watches the tail
 * for up to spin_ns without a system call (a record that close costs the producer no
 * FUTEX_WAKE and this side no sleep; the loop never yields its CPU). Returns 1 when the
 * queue holds a record, 0 otherwise (timed out, rung for a frame, or a signal came: the
 * caller looks at its socket and signals). Either way the word is cleared on return. */
int sl_q_sleep(uint64_t *ctl, int64_t spin_ns, int64_t timeout_ns) {
    uint32_t *w = sl_q_word(ctl);
    if (spin_ns > 0) {
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (unsigned i = 1;; i++) {
            if (__atomic_load_n(&ctl[SL_Q_TAIL], __ATOMIC_ACQUIRE) !=
                __atomic_load_n(&ctl[SL_Q_HEAD], __ATOMIC_RELAXED))
                goto done;
            if (!__atomic_load_n(w, __ATOMIC_ACQUIRE))
                goto done;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
            if (i % 64 == 0) {
                clock_gettime(CLOCK_MONOTONIC, &t);
                if ((t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) >= spin_ns)
                    break;
            }
        }
    }
    sl_futex_wait(w, SL_Q_FUTEX, timeout_ns);
done:
    __atomic_store_n(w, 0, __ATOMIC_SEQ_CST);
    return __atomic_load_n(&ctl[SL_Q_TAIL], __ATOMIC_ACQUIRE) !=
           __atomic_load_n(&ctl[SL_Q_HEAD], __ATOMIC_RELAXED);
}

/* The consumer is awake again: no wake-up is wanted. */
void sl_q_disarm(uint64_t *ctl) {
    __atomic_store_n(sl_q_word(ctl), 0, __ATOMIC_SEQ_CST);
}

/* Words published and not yet popped (a snapshot). */
size_t sl_q_used(uint64_t *ctl) {
    return (size_t)(__atomic_load_n(&ctl[SL_Q_TAIL], __ATOMIC_ACQUIRE) -
                    __atomic_load_n(&ctl[SL_Q_HEAD], __ATOMIC_ACQUIRE));
}

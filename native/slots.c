/* The shmloader C helper: atomic slot states and the parent-death signal. Kept tiny. */
#include <stdint.h>
#include <stddef.h>
#include <errno.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>

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

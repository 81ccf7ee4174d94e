/* Declarations of the shmloader C helper, in the subset of C that cffi's cdef reads.
 *
 * Slot states are 32-bit words in a shared mapping. Every access goes through these
 * functions so that each one is a real atomic with the stated memory order: a worker's
 * writes into a slot happen-before the consumer reads them, because the worker
 * publishes with a release store and the consumer observes with an acquire load. */

uint32_t sl_load(uint32_t *states, size_t index);
void sl_store(uint32_t *states, size_t index, uint32_t value);
int sl_cas(uint32_t *states, size_t index, uint32_t expected, uint32_t desired);
int sl_find_and_claim(uint32_t *states, size_t count, size_t start, uint32_t expected, uint32_t desired);
size_t sl_count(uint32_t *states, size_t count, uint32_t value);
int sl_set_pdeathsig(int signum);
void *sl_map(int fd, size_t size, int populate);
int sl_unmap(void *addr, size_t size);

/* Stream-socket I/O that carries a descriptor beside the bytes (SCM_RIGHTS). Python's
 * os.read/os.write cannot, and a socket object would own (and one day close) a descriptor
 * that a Connection owns. Both return bytes moved, 0 at EOF, or -errno (EINTR included:
 * the caller retries after Python has run its signal handlers). */
long sl_send_fd(int sock, const void *buf, size_t len, int fd);
long sl_recv(int sock, void *buf, size_t len, int *fd_out);

/* Sleeping on a 32-bit word of shared memory (Linux futexes; elsewhere sl_has_futex()
 * is 0 and both calls return -ENOSYS). */
int sl_has_futex(void);
int sl_futex_wait(uint32_t *word, uint32_t expected, int64_t timeout_ns);
int sl_futex_wake(uint32_t *word, int n);

/* Single-producer single-consumer queues of int64 records in shared memory, with a
 * sleeping flag that never loses a wake-up (see slots.c; shmloader.channel uses them). */
int sl_q_push(uint64_t *ctl, int64_t *data, size_t cap, int64_t kind, int64_t slot, int64_t seq,
              int64_t stamp, const char *payload, size_t words, int wake);
int sl_q_take_sleeper(uint64_t *ctl);
int sl_q_ring(uint64_t *ctl, uint64_t frames);
uint64_t sl_q_frames(uint64_t *ctl);
int64_t sl_q_woken_at(uint64_t *ctl);
int sl_q_push3(uint64_t *ctl, int64_t *data, size_t cap, int64_t kind, int64_t slot, int64_t seq,
               int64_t stamp, int64_t a, int64_t b, int64_t c);
size_t sl_q_pop(uint64_t *ctl, int64_t *data, size_t cap, int64_t *out, size_t out_cap);
int sl_q_arm(uint64_t *ctl, uint32_t how);
int sl_q_sleep(uint64_t *ctl, int64_t spin_ns, int64_t timeout_ns);
void sl_q_disarm(uint64_t *ctl);
size_t sl_q_used(uint64_t *ctl);

/* Declarations cffi sees (native/build_jpeg.py): the region decoder's interface. */
int shmjpeg_abi(void);
int shmjpeg_bind(const uintptr_t *fns, int n, char *msg, int msglen);
int shmjpeg_region(const unsigned char *data, size_t len, int denom, int fast_dct,
                   int fast_upsample, int x0, int y0, int x1, int y1, int keep0, int keep1,
                   unsigned char *out, size_t cap, int *geom, char *msg, int msglen);

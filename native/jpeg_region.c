/* Region JPEG decoding for shmloader.vision: decode only the rows and MCU columns a crop
 * needs (jpeg_skip_scanlines + jpeg_crop_scanline), optionally DCT-downscaled
 * (scale_denom 2, 4, 8), with libjpeg-turbo's libjpeg API.
 *
 * No libjpeg is linked in: shmjpeg_bind() receives the addresses of the library's
 * functions, looked up at run time in a libjpeg-turbo of the ABI shmjpeg_abi() names
 * (shmloader/vision/region.py: Pillow's wheel ships one of ABI 62). The struct layouts
 * come from the libjpeg-turbo headers of the build environment (native/build_jpeg.py);
 * jpeg_CreateDecompress checks both the version and sizeof(struct jpeg_decompress_struct),
 * so a library of another ABI fails with an error here, and the caller falls back to a
 * full decode. */

#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "jpeglib.h"

enum { SHMJPEG_OK = 0, SHMJPEG_UNSUPPORTED = 1, SHMJPEG_ERROR = 2, SHMJPEG_SMALL = 3 };

typedef struct jpeg_error_mgr *(*std_error_fn)(struct jpeg_error_mgr *);
typedef void (*create_fn)(j_decompress_ptr, int, size_t);
typedef void (*destroy_fn)(j_decompress_ptr);
typedef void (*mem_src_fn)(j_decompress_ptr, const unsigned char *, unsigned long);
typedef int (*read_header_fn)(j_decompress_ptr, boolean);
typedef boolean (*start_fn)(j_decompress_ptr);
typedef void (*crop_fn)(j_decompress_ptr, JDIMENSION *, JDIMENSION *);
typedef JDIMENSION (*skip_fn)(j_decompress_ptr, JDIMENSION);
typedef JDIMENSION (*read_fn)(j_decompress_ptr, JSAMPARRAY, JDIMENSION);
typedef void (*abort_fn)(j_decompress_ptr);

/* The libjpeg ABI the headers declared at build time (62: libjpeg 6b, 70, 80): the
 * library bound must have it. */
int shmjpeg_abi(void) { return JPEG_LIB_VERSION; }

/* The order shmjpeg_bind expects (region.py's _FUNCTIONS). */
static struct {
    std_error_fn std_error;
    create_fn create;
    destroy_fn destroy;
    mem_src_fn mem_src;
    read_header_fn read_header;
    start_fn start;
    crop_fn crop;
    skip_fn skip;
    read_fn read;
    abort_fn abort_;
    int bound;
} api;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int warned;
    char msg[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    err->pub.format_message(cinfo, err->msg);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    error_mgr *err = (error_mgr *)cinfo->err;
    if (level < 0 && !err->warned) { /* corrupt data: the caller decodes in full (and fails there) */
        err->warned = 1;
        err->pub.format_message(cinfo, err->msg);
    }
}

/* libjpeg's standard error manager, with our handlers: an error longjmps to err->jump
 * (set by the caller: setjmp must stay in the function that decodes), a warning is kept. */
static struct jpeg_error_mgr *init_errors(error_mgr *err) {
    memset(err, 0, sizeof *err);
    struct jpeg_error_mgr *pub = api.std_error(&err->pub);
    err->pub.error_exit = on_error;
    err->pub.emit_message = on_message;
    return pub;
}

static void set_msg(char *msg, int msglen, const char *text) {
    if (msg != NULL && msglen > 0) snprintf(msg, (size_t)msglen, "%s", text);
}

int shmjpeg_bind(const uintptr_t *fns, int n, char *msg, int msglen) {
    void **slots = (void **)&api;
    if (n != 10) {
        set_msg(msg, msglen, "shmjpeg_bind wants the 10 libjpeg functions");
        return SHMJPEG_ERROR;
    }
    for (int i = 0; i < n; i++) {
        if (fns[i] == 0) {
            set_msg(msg, msglen, "a libjpeg function is missing");
            return SHMJPEG_ERROR;
        }
        slots[i] = (void *)fns[i];
    }
    /* A trial: does the library accept our struct layout? (version 62, our sizeof) */
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    cinfo.err = init_errors(&err);
    if (setjmp(err.jump)) {
        set_msg(msg, msglen, err.msg);
        api.destroy(&cinfo);
        return SHMJPEG_ERROR;
    }
    api.create(&cinfo, JPEG_LIB_VERSION, sizeof(struct jpeg_decompress_struct));
    api.destroy(&cinfo);
    api.bound = 1;
    return SHMJPEG_OK;
}

/* Decode the rows [y0, y1) and (at least) the columns [x0, x1) of the image scaled by
 * 1/denom (denom 1, 2, 4 or 8), as RGB, into out (rows of geom[2] * 3 bytes).
 * With keep1 > keep0 (within [x0, x1)), only the columns [keep0, keep1) are kept: each
 * row is moved left as soon as it is decoded, so that out holds exactly those columns,
 * contiguous (what a resampler reads without an unpacking copy).
 *
 * geom receives: [0] the first column decoded (x0 moved left to an iMCU boundary; keep0
 * when keeping), [1] the first row (y0), [2] the width decoded (or kept), [3] the rows
 * decoded, [4] and [5] the scaled image's width and height. Returns SHMJPEG_OK;
 * SHMJPEG_UNSUPPORTED when the region decode does not apply (colour space other than
 * YCbCr/grayscale/RGB, corrupt data that libjpeg only warns about: the caller decodes
 * in full, and names the error there); SHMJPEG_ERROR with msg set; SHMJPEG_SMALL when
 * cap is less than (the decoded) geom[2] * geom[3] * 3 (geom then says how much is
 * needed). */
int shmjpeg_region(const unsigned char *data, size_t len, int denom, int fast_dct,
                   int fast_upsample, int x0, int y0, int x1, int y1, int keep0, int keep1,
                   unsigned char *out, size_t cap, int *geom, char *msg, int msglen) {
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    volatile int status = SHMJPEG_OK;
    if (!api.bound) {
        set_msg(msg, msglen, "the libjpeg functions are not bound");
        return SHMJPEG_ERROR;
    }
    cinfo.err = init_errors(&err);
    if (setjmp(err.jump)) {
        set_msg(msg, msglen, err.msg);
        api.destroy(&cinfo);
        return SHMJPEG_ERROR;
    }
    api.create(&cinfo, JPEG_LIB_VERSION, sizeof(struct jpeg_decompress_struct));
    api.mem_src(&cinfo, data, (unsigned long)len);
    api.read_header(&cinfo, TRUE);
    if (err.warned || cinfo.num_components < 1 ||
        !(cinfo.jpeg_color_space == JCS_YCbCr || cinfo.jpeg_color_space == JCS_GRAYSCALE ||
          cinfo.jpeg_color_space == JCS_RGB)) {
        set_msg(msg, msglen, err.warned ? err.msg : "colour space");
        api.destroy(&cinfo);
        return SHMJPEG_UNSUPPORTED;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    cinfo.dct_method = fast_dct ? JDCT_IFAST : JDCT_ISLOW;
    cinfo.do_fancy_upsampling = fast_upsample ? FALSE : TRUE;
    api.start(&cinfo);
    int full_w = (int)cinfo.output_width, full_h = (int)cinfo.output_height;
    if (x0 < 0) x0 = 0;
    if (y0 < 0) y0 = 0;
    if (x1 > full_w) x1 = full_w;
    if (y1 > full_h) y1 = full_h;
    if (x1 <= x0 || y1 <= y0 || cinfo.output_components != 3) {
        set_msg(msg, msglen, x1 <= x0 || y1 <= y0 ? "empty region" : "not 3 output components");
        api.destroy(&cinfo);
        return x1 <= x0 || y1 <= y0 ? SHMJPEG_ERROR : SHMJPEG_UNSUPPORTED;
    }
    JDIMENSION xoff = (JDIMENSION)x0, width = (JDIMENSION)(x1 - x0);
    if (width < (JDIMENSION)full_w) api.crop(&cinfo, &xoff, &width);
    else xoff = 0;
    int rows = y1 - y0;
    size_t stride = (size_t)width * 3;
    geom[0] = (int)xoff;
    geom[1] = y0;
    geom[2] = (int)width;
    geom[3] = rows;
    geom[4] = full_w;
    geom[5] = full_h;
    if (cap < stride * (size_t)rows) {
        api.destroy(&cinfo);
        return SHMJPEG_SMALL;
    }
    /* Keep [keep0, keep1): rows land at `stride` apart, then move to `kept` apart. Row
     * r's kept bytes go to [r * kept, (r + 1) * kept), below every row not yet moved
     * (at r' * stride, r' > r) and every row not yet decoded: safe in place. */
    int keeping = keep1 > keep0 && keep0 >= (int)xoff && keep1 <= (int)(xoff + width) &&
                  (keep0 > (int)xoff || keep1 < (int)(xoff + width));
    size_t kept = keeping ? (size_t)(keep1 - keep0) * 3 : stride;
    size_t shift = keeping ? (size_t)(keep0 - (int)xoff) * 3 : 0;
    if (keeping) {
        geom[0] = keep0;
        geom[2] = keep1 - keep0;
    }
    if (y0 > 0) api.skip(&cinfo, (JDIMENSION)y0);
    int done = 0;
    while (done < rows) {
        JSAMPROW row_ptrs[16];
        int want = rows - done < 16 ? rows - done : 16;
        for (int i = 0; i < want; i++) row_ptrs[i] = out + stride * (size_t)(done + i);
        JDIMENSION got = api.read(&cinfo, row_ptrs, (JDIMENSION)want);
        if (got == 0) break;
        if (keeping)
            for (int i = done; i < done + (int)got; i++)
                memmove(out + kept * (size_t)i, out + stride * (size_t)i + shift, kept);
        done += (int)got;
    }
    if (err.warned || done < rows) {
        set_msg(msg, msglen, err.warned ? err.msg : "fewer rows than the header says");
        status = SHMJPEG_UNSUPPORTED;
    }
    api.abort_(&cinfo);
    api.destroy(&cinfo);
    return status;
}

/* Pillow's antialiased bilinear resize of an 8-bit RGB image, bit for bit, and the
 * per-level table write of torchvision's tensor ops (shmloader.vision.torchvision_fused).
 *
 * What Pillow computes for Image.resize(size, BILINEAR) of a whole 8-bit image, stated
 * in our own terms (Pillow's documented algorithm: a separable convolution with a
 * triangle filter widened by the downscale factor, fixed-point weights):
 *   - per output sample o along an axis of n_in inputs and n_out outputs: the scale
 *     s = n_in / n_out, the filter's reach r = max(s, 1), the centre c = (o + 0.5) * s;
 *     the inputs lo .. hi - 1 with lo = trunc(c - r + 0.5) clamped to 0 and
 *     hi = trunc(c + r + 0.5) clamped to n_in; weight of input i: tent((i - c + 0.5) / r),
 *     tent(x) = max(1 - |x|, 0), divided by the weights' sum (in double), then made
 *     fixed point with 22 fraction bits, rounded half away from zero;
 *   - the horizontal pass first (when the width changes), over the input rows the
 *     vertical pass reads, each sum started at one half (1 << 21), shifted right by 22
 *     and clamped to 0..255; then the vertical pass (when the height changes) on that
 *     8-bit intermediate, the same way. Pillow 13 runs the vertical pass first where the
 *     height loses more than twice as many pixels as the width (vertical_first_rule;
 *     earlier versions never do).
 * The Python side checks this against the installed Pillow once per process before
 * using it (torchvision_fused.bilinear_matches_pillow), and uses Pillow otherwise. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SHMPIL_FRACTION 22

#if defined(__GNUC__) && !defined(__clang__)
#define SHMPIL_VECTORIZE __attribute__((optimize("O3")))
#else
#define SHMPIL_VECTORIZE
#endif

typedef struct {
    int taps;     /* weights stored per output sample */
    int *first;   /* first input of each output sample */
    int *count;   /* inputs each output sample reads */
    int32_t *w;   /* taps weights per output sample, fixed point */
} shmpil_axis;

static double shmpil_tent(double x) {
    if (x < 0.0) x = -x;
    return x < 1.0 ? 1.0 - x : 0.0;
}

static void shmpil_axis_free(shmpil_axis *a) {
    free(a->first);
    free(a->w);
    a->first = NULL;
    a->w = NULL;
}

/* The weights of the span lo_edge .. hi_edge of an axis of n_in inputs resampled to n_out
 * outputs (the whole axis: 0 .. n_in); 0 on success. */
static int shmpil_axis_make(int n_in, double lo_edge, double hi_edge, int n_out, shmpil_axis *a) {
    float lo = (float)lo_edge, hi_f = (float)hi_edge; /* Pillow carries the box edges as floats */
    double start = lo;
    double scale = (double)(float)(hi_f - lo) / n_out; /* and their span, a float too */
    double reach = scale < 1.0 ? 1.0 : scale;
    double inverse = 1.0 / reach;
    int taps = (int)ceil(reach) * 2 + 1;
    double *raw = malloc(sizeof(double) * (size_t)taps);
    a->taps = taps;
    a->first = malloc(sizeof(int) * 2 * (size_t)n_out);
    a->w = malloc(sizeof(int32_t) * (size_t)taps * (size_t)n_out);
    if (raw == NULL || a->first == NULL || a->w == NULL) {
        free(raw);
        shmpil_axis_free(a);
        return -1;
    }
    a->count = a->first + n_out;
    for (int o = 0; o < n_out; o++) {
        double centre = start + (o + 0.5) * scale;
        int lo = (int)(centre - reach + 0.5);
        int hi = (int)(centre + reach + 0.5);
        double sum = 0.0;
        if (lo < 0) lo = 0;
        if (hi > n_in) hi = n_in;
        for (int t = 0; t < hi - lo; t++) {
            raw[t] = shmpil_tent((t + lo - centre + 0.5) * inverse);
            sum += raw[t];
        }
        int32_t *w = a->w + (size_t)o * taps;
        for (int t = 0; t < taps; t++) {
            double v = 0.0;
            if (t < hi - lo) v = sum != 0.0 ? raw[t] / sum : raw[t];
            w[t] = (int32_t)(v < 0 ? -0.5 + v * (1 << SHMPIL_FRACTION) : 0.5 + v * (1 << SHMPIL_FRACTION));
        }
        a->first[o] = lo;
        a->count[o] = hi - lo;
    }
    free(raw);
    return 0;
}

static inline uint8_t shmpil_level(int32_t sum) {
    int32_t v = sum >> SHMPIL_FRACTION;
    return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
}

/* Rows row0 .. row0 + rows - 1 of src (width w_in) resampled to out_w columns. */
static void shmpil_horizontal(const uint8_t *src, int w_in, int row0, int rows, const shmpil_axis *a,
                              int out_w, uint8_t *dst) {
    const int32_t half = 1 << (SHMPIL_FRACTION - 1);
    for (int y = 0; y < rows; y++) {
        const uint8_t *line = src + (size_t)(row0 + y) * w_in * 3;
        uint8_t *out = dst + (size_t)y * out_w * 3;
        for (int o = 0; o < out_w; o++) {
            const int32_t *w = a->w + (size_t)o * a->taps;
            const uint8_t *p = line + (size_t)a->first[o] * 3;
            int32_t r = half, g = half, b = half;
            for (int t = 0; t < a->count[o]; t++, p += 3) {
                r += p[0] * w[t];
                g += p[1] * w[t];
                b += p[2] * w[t];
            }
            out[o * 3] = shmpil_level(r);
            out[o * 3 + 1] = shmpil_level(g);
            out[o * 3 + 2] = shmpil_level(b);
        }
    }
}

/* src (rows of `values` bytes) resampled along its rows to out_h rows; row0: the first
 * row of src is row row0 of the axis. acc: `values` int32 of scratch. */
SHMPIL_VECTORIZE
static void shmpil_vertical(const uint8_t *src, int values, int row0, const shmpil_axis *a, int out_h,
                            uint8_t *dst, int32_t *acc) {
    const int32_t half = 1 << (SHMPIL_FRACTION - 1);
    for (int o = 0; o < out_h; o++) {
        const int32_t *w = a->w + (size_t)o * a->taps;
        for (int i = 0; i < values; i++) acc[i] = half;
        for (int t = 0; t < a->count[o]; t++) {
            const uint8_t *line = src + (size_t)(a->first[o] - row0 + t) * values;
            const int32_t k = w[t];
            for (int i = 0; i < values; i++) acc[i] += line[i] * k;
        }
        uint8_t *out = dst + (size_t)o * values;
        for (int i = 0; i < values; i++) {
            int32_t v = acc[i] >> SHMPIL_FRACTION;
            out[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
        }
    }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define SHMPIL_X86 1
#include <immintrin.h>

/* The same two passes with AVX2: identical integer arithmetic (32-bit products and
 * sums, the same rounding and clamping), eight lanes at a time. */
__attribute__((target("avx2"))) static void shmpil_vertical_avx2(const uint8_t *src, int values, int row0,
                                                                 const shmpil_axis *a, int out_h, uint8_t *dst,
                                                                 int32_t *acc) {
    const int32_t half = 1 << (SHMPIL_FRACTION - 1);
    (void)acc;
    for (int o = 0; o < out_h; o++) {
        const int32_t *w = a->w + (size_t)o * a->taps;
        const uint8_t *base = src + (size_t)(a->first[o] - row0) * values;
        uint8_t *out = dst + (size_t)o * values;
        int i = 0;
        for (; i + 16 <= values; i += 16) {
            __m256i s0 = _mm256_set1_epi32(half), s1 = s0;
            for (int t = 0; t < a->count[o]; t++) {
                const uint8_t *p = base + (size_t)t * values + i;
                __m256i k = _mm256_set1_epi32(w[t]);
                __m128i px = _mm_loadu_si128((const __m128i *)p);
                s0 = _mm256_add_epi32(s0, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(px), k));
                s1 = _mm256_add_epi32(s1, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(px, 8)), k));
            }
            s0 = _mm256_srai_epi32(s0, SHMPIL_FRACTION);
            s1 = _mm256_srai_epi32(s1, SHMPIL_FRACTION);
            __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(s0, s1), 0xD8);
            __m128i b8 = _mm_packus_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
            _mm_storeu_si128((__m128i *)(out + i), b8);
        }
        for (; i < values; i++) {
            int32_t sum = half;
            for (int t = 0; t < a->count[o]; t++) sum += base[(size_t)t * values + i] * w[t];
            out[i] = shmpil_level(sum);
        }
    }
}

__attribute__((target("avx2"))) static void shmpil_horizontal_avx2(const uint8_t *src, const uint8_t *end,
                                                                   int w_in, int row0, int rows,
                                                                   const shmpil_axis *a, int out_w,
                                                                   uint8_t *dst) {
    const int32_t half = 1 << (SHMPIL_FRACTION - 1);
    const size_t stride = (size_t)w_in * 3;
    const __m256i byte = _mm256_set1_epi32(0xFF);
    const __m256i rowsteps = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                _mm256_set1_epi32((int)stride));
    int y = 0;
    /* Eight rows at once, one output column at a time: the weights are the same for
     * every row, each lane gathers its row's pixel (4 bytes: R, G, B and one more, so
     * the group's last byte read must stay inside the buffer). */
    for (; y + 8 <= rows; y += 8) {
        const uint8_t *line = src + (size_t)(row0 + y) * stride;
        if (line + 7 * stride + (size_t)w_in * 3 + 1 > end) break;
        for (int o = 0; o < out_w; o++) {
            const int32_t *w = a->w + (size_t)o * a->taps;
            const uint8_t *p = line + (size_t)a->first[o] * 3;
            __m256i r = _mm256_set1_epi32(half), g = r, b = r;
            for (int t = 0; t < a->count[o]; t++, p += 3) {
                __m256i px = _mm256_i32gather_epi32((const int *)p, rowsteps, 1);
                __m256i k = _mm256_set1_epi32(w[t]);
                r = _mm256_add_epi32(r, _mm256_mullo_epi32(_mm256_and_si256(px, byte), k));
                g = _mm256_add_epi32(g, _mm256_mullo_epi32(_mm256_and_si256(_mm256_srli_epi32(px, 8), byte), k));
                b = _mm256_add_epi32(b, _mm256_mullo_epi32(_mm256_and_si256(_mm256_srli_epi32(px, 16), byte), k));
            }
            int32_t lr[8], lg[8], lb[8];
            _mm256_storeu_si256((__m256i *)lr, r);
            _mm256_storeu_si256((__m256i *)lg, g);
            _mm256_storeu_si256((__m256i *)lb, b);
            uint8_t *out = dst + (size_t)y * out_w * 3 + (size_t)o * 3;
            for (int j = 0; j < 8; j++, out += (size_t)out_w * 3) {
                out[0] = shmpil_level(lr[j]);
                out[1] = shmpil_level(lg[j]);
                out[2] = shmpil_level(lb[j]);
            }
        }
    }
    if (y < rows) shmpil_horizontal(src, w_in, row0 + y, rows - y, a, out_w, dst + (size_t)y * out_w * 3);
}
#endif

/* The passes this CPU runs fastest (AVX2 where it has it). */
static void shmpil_pass_horizontal(const uint8_t *src, size_t src_len, int w_in, int row0, int rows,
                                   const shmpil_axis *a, int out_w, uint8_t *dst) {
#ifdef SHMPIL_X86
    if (__builtin_cpu_supports("avx2")) {
        shmpil_horizontal_avx2(src, src + src_len, w_in, row0, rows, a, out_w, dst);
        return;
    }
#endif
    (void)src_len;
    shmpil_horizontal(src, w_in, row0, rows, a, out_w, dst);
}

static void shmpil_pass_vertical(const uint8_t *src, int values, int row0, const shmpil_axis *a, int out_h,
                                 uint8_t *dst, int32_t *acc) {
#ifdef SHMPIL_X86
    if (__builtin_cpu_supports("avx2")) {
        shmpil_vertical_avx2(src, values, row0, a, out_h, dst, acc);
        return;
    }
#endif
    shmpil_vertical(src, values, row0, a, out_h, dst, acc);
}

int shmpil_bilinear_rgb_box(const uint8_t *src, int w_in, int h_in, double x0, double y0, double x1, double y1,
                            uint8_t *dst, int out_w, int out_h, int vertical_first_rule);

/* Image.resize((out_w, out_h), BILINEAR) of the w_in x h_in RGB image src (rows of
 * w_in * 3 bytes) into dst (out_h rows of out_w * 3 bytes). 0 on success, -1 when out
 * of memory. The passes run in Pillow's order: horizontal first, except where the
 * height shrinks by more than twice as many pixels as the width does (Pillow 13). */
int shmpil_bilinear_rgb(const uint8_t *src, int w_in, int h_in, uint8_t *dst, int out_w, int out_h,
                        int vertical_first_rule) {
    return shmpil_bilinear_rgb_box(src, w_in, h_in, 0.0, 0.0, w_in, h_in, dst, out_w, out_h, vertical_first_rule);
}

/* The same of the box x0 .. x1, y0 .. y1 of src (fractional pixel edges, as
 * Image.resize(size, BILINEAR, box=...)): each output sample's filter is centred in the
 * box, and reads src's pixels around it, stopping at src's edges. */
int shmpil_bilinear_rgb_box(const uint8_t *src, int w_in, int h_in, double x0, double y0, double x1, double y1,
                            uint8_t *dst, int out_w, int out_h, int vertical_first_rule) {
    size_t src_len = (size_t)w_in * h_in * 3;
    int across = out_w != w_in || x0 != 0.0 || x1 != w_in;
    int down = out_h != h_in || y0 != 0.0 || y1 != h_in;
    int vertical_first = vertical_first_rule && (h_in - out_h) > 0 && (h_in - out_h) > (w_in - out_w) * 2;
    shmpil_axis v = {0}, h = {0};
    uint8_t *mid = NULL;
    int32_t *acc = NULL;
    int status = -1;
    if (!across && !down) {
        memcpy(dst, src, (size_t)w_in * h_in * 3);
        return 0;
    }
    if (down && shmpil_axis_make(h_in, y0, y1, out_h, &v) != 0) goto done;
    if (across && shmpil_axis_make(w_in, x0, x1, out_w, &h) != 0) goto done;
    if (down) {
        acc = malloc(sizeof(int32_t) * (size_t)(out_w > w_in ? out_w : w_in) * 3);
        if (acc == NULL) goto done;
    }
    if (!down) {
        shmpil_pass_horizontal(src, src_len, w_in, 0, h_in, &h, out_w, dst);
    } else if (!across) {
        shmpil_pass_vertical(src, w_in * 3, 0, &v, out_h, dst, acc);
    } else if (vertical_first) {
        mid = malloc((size_t)out_h * w_in * 3);
        if (mid == NULL) goto done;
        shmpil_pass_vertical(src, w_in * 3, 0, &v, out_h, mid, acc);
        shmpil_pass_horizontal(mid, (size_t)out_h * w_in * 3, w_in, 0, out_h, &h, out_w, dst);
    } else {
        /* only the rows the vertical pass reads */
        int row0 = v.first[0];
        int rows = v.first[out_h - 1] + v.count[out_h - 1] - row0;
        mid = malloc((size_t)rows * out_w * 3);
        if (mid == NULL) goto done;
        shmpil_pass_horizontal(src, src_len, w_in, row0, rows, &h, out_w, mid);
        shmpil_pass_vertical(mid, out_w * 3, row0, &v, out_h, dst, acc);
    }
    status = 0;
done:
    free(mid);
    free(acc);
    shmpil_axis_free(&v);
    shmpil_axis_free(&h);
    return status;
}

/* table[c * 256 + level] of each value of the h x w RGB image src, written channels
 * first into dst (3 planes of h x w floats), mirrored left-right when flip. */
int shmpil_levels_chw_f32(const uint8_t *src, int w, int h, const float *table, float *dst, int flip) {
    size_t plane = (size_t)w * h;
    for (int y = 0; y < h; y++) {
        const uint8_t *line = src + (size_t)y * w * 3;
        float *r = dst + (size_t)y * w, *g = r + plane, *b = g + plane;
        for (int x = 0; x < w; x++) {
            int to = flip ? w - 1 - x : x;
            r[to] = table[line[x * 3]];
            g[to] = table[256 + line[x * 3 + 1]];
            b[to] = table[512 + line[x * 3 + 2]];
        }
    }
    return 0;
}

/* Declarations cffi sees (native/build_jpeg.py): Pillow's bilinear resize, reproduced. */
int shmpil_bilinear_rgb(const uint8_t *src, int w_in, int h_in, uint8_t *dst, int out_w, int out_h,
                        int vertical_first_rule);
int shmpil_bilinear_rgb_box(const uint8_t *src, int w_in, int h_in, double x0, double y0, double x1, double y1,
                            uint8_t *dst, int out_w, int out_h, int vertical_first_rule);
int shmpil_levels_chw_f32(const uint8_t *src, int w, int h, const float *table, float *dst, int flip);

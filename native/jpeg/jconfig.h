/* jconfig.h for shmloader's region decoder: the libjpeg 6b ABI (JPEG_LIB_VERSION 62),
 * 8-bit samples, as libjpeg-turbo builds it by default (the library that Pillow's wheels
 * bundle as libjpeg.so.62). Only the struct layouts and types matter here: the library
 * itself is loaded at run time, and jpeg_CreateDecompress checks the version and the
 * struct size, so a library of another ABI is refused cleanly. */
#define JPEG_LIB_VERSION  62
#define LIBJPEG_TURBO_VERSION  2.1.5
#define LIBJPEG_TURBO_VERSION_NUMBER  2001005
#define C_ARITH_CODING_SUPPORTED 1
#define D_ARITH_CODING_SUPPORTED 1
#define MEM_SRCDST_SUPPORTED 1
#define BITS_IN_JSAMPLE  8

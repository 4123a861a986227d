/* Cascade C ABI. Keep in sync with ffi/src/lib.rs. */
#ifndef CASCADE_H
#define CASCADE_H
#ifdef __cplusplus
extern "C" {
#endif

/* The library version, a static NUL-terminated string. */
const char *cascade_version(void);

#ifdef __cplusplus
}
#endif
#endif

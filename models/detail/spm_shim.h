// The C ABI of libtreeserve_spm.so, the only code that touches sentencepiece.
// tokenizer.cpp dlopen()s the shim with RTLD_DEEPBIND so that sentencepiece's
// bundled protobuf runtime never meets gRPC's protobuf (two protobuf runtimes in one
// symbol namespace clash). Plain C types only; buffers the shim returns are malloc'ed by
// the shim and released with treeserve_spm_free_buffer.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bumped whenever a signature below changes; tokenizer.cpp refuses a mismatched shim.
#define TREESERVE_SPM_ABI_VERSION 1

typedef struct TreeserveSpm TreeserveSpm;

int treeserve_spm_abi_version(void);

// Returns NULL on failure and writes a message into err (NUL-terminated, truncated
// to err_len).
TreeserveSpm* treeserve_spm_load(const char* model_file, char* err, size_t err_len);
void treeserve_spm_free(TreeserveSpm* spm);

// Return 0 on success, non-zero with a message in err on failure. *out is malloc'ed.
int treeserve_spm_encode(const TreeserveSpm* spm, const char* text, size_t text_len,
                         int32_t** out_ids, size_t* out_count, char* err, size_t err_len);
int treeserve_spm_decode(const TreeserveSpm* spm, const int32_t* ids, size_t count, char** out_text,
                         size_t* out_len, char* err, size_t err_len);
// The piece string of id (e.g. "\xe2\x96\x81the", "<0x0A>"); "" when id is out of range.
int treeserve_spm_piece(const TreeserveSpm* spm, int32_t id, char** out_text, size_t* out_len);

int32_t treeserve_spm_vocab_size(const TreeserveSpm* spm);
int32_t treeserve_spm_bos_id(const TreeserveSpm* spm);
int32_t treeserve_spm_eos_id(const TreeserveSpm* spm);

void treeserve_spm_free_buffer(void* buffer);

#ifdef __cplusplus
}
#endif

// mars::decode_attention (decode_attention.cpp), for the other sources of the same library.
#pragma once
#include <ATen/ATen.h>

// Query columns per row the kernel takes: decode steps and prefills up to this width (a prefill's queries then give
// the same bits whatever rides along, so lossless verify's prefill, the prompt and two masks, agrees with AR's bit
// for bit; SDPA's flash kernel does not: 2 more queries change the first ones' outputs at 64, 100, 400 and 800).
// The kernel runs each query's loops over the keys, 8 query columns a task, not a blocked GEMM, and is still faster
// than SDPA for prefills up to this width; past it prefills go to SDPA.  The width that decides is the caller's
// where it gives one (`width`: lossless verify's prefill of a 1023-token prompt and its two masks counts as AR's of
// the prompt alone, so that both take the kernel), else the queries per row.
constexpr int64_t kDecodeAttentionMaxQueries = 1024;

// softmax(scale q k^T + mask) v for query [batch, heads, queries, dim], key/value [batch, kv heads, length, dim]
// (heads grouped over kv heads), mask None or [batch or 1, 1 or heads, queries, length] (additive fp32 or bool,
// true = visible): the kernel for a decode step's fp32 attention (decode_attention_takes), otherwise
// at::scaled_dot_product_attention(query, key, value, mask, scale, enable_gqa when grouped), not causal.
// `width`: the step's queries per row against kDecodeAttentionMaxQueries (None: query.size(2)).
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& mask, double scale,
                            c10::optional<int64_t> width = c10::nullopt);

// Whether decode_attention runs its kernel on these inputs: fp32 on the CPU, a width (`width`, else the queries per
// row) of at most kDecodeAttentionMaxQueries, a head dimension of at most 256, keys with a contiguous last dimension, and a mask of the
// step's shape (or none for a single query).
bool decode_attention_takes(const at::Tensor& query, const at::Tensor& key, const c10::optional<at::Tensor>& mask,
                            c10::optional<int64_t> width = c10::nullopt);

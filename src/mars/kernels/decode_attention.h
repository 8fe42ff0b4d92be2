// mars::decode_attention (decode_attention.cpp), for the other sources of the same library.
#pragma once
#include <ATen/ATen.h>

// Query columns per row the kernel takes; wider inputs (prefills) belong to SDPA's blocked flash kernel.
constexpr int64_t kDecodeAttentionMaxQueries = 16;

// softmax(scale q k^T + mask) v for query [batch, heads, queries, dim], key/value [batch, kv heads, length, dim]
// (heads grouped over kv heads), mask None or [batch or 1, 1 or heads, queries, length] (additive fp32 or bool,
// true = visible): the kernel for a decode step's fp32 attention (decode_attention_takes), otherwise
// at::scaled_dot_product_attention(query, key, value, mask, scale, enable_gqa when grouped), not causal.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& mask, double scale);

// Whether decode_attention runs its kernel on these inputs: fp32 on the CPU, at most kDecodeAttentionMaxQueries
// queries per row, a head dimension of at most 256, keys with a contiguous last dimension, and a mask of the
// step's shape (or none for a single query).
bool decode_attention_takes(const at::Tensor& query, const at::Tensor& key, const c10::optional<at::Tensor>& mask);

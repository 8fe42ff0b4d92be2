// The small-M GEMM kernels of small_gemm.cpp, for the other sources of the same library.
#pragma once
#include <ATen/ATen.h>

#include <vector>

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

at::Tensor lowrank_linear(const at::Tensor& x, const at::Tensor& weight, c10::optional<int64_t> rows);

// One weight of a fused_linear pass as the kernel reads it: raw pointers into tensors someone keeps alive, and a
// gated LoRA's factors (lora_down null: none; the up factor packed by pack_lowrank; bf16 flags: the factor's
// element).  prepare_fused checks and builds them once, so a caller running the same weights every step (the C++
// decoder step: 120 passes a step) does not re-read every tensor's metadata after each pass's weight stream has
// pushed it out of the caches.
struct FusedWeight {
  const float* w = nullptr;
  const float* bias = nullptr;
  int64_t n = 0, k = 0;  // the weight's [n, k]
  const void* lora_down = nullptr;  // A [r, k]
  const void* lora_up = nullptr;    // B packed
  int64_t r = 0;
  float scaling = 0.0f;
  bool down_bf16 = false, up_bf16 = false;
};

// fused_linear's weights, biases and (empty lists: none) LoRA factors, checked; `keep` receives the tensors the
// pointers point into (the weights themselves where contiguous), which the caller keeps alive and unchanged.
std::vector<FusedWeight> prepare_fused(at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& biases,
                                       const c10::List<c10::optional<at::Tensor>>& lora_a,
                                       const c10::List<c10::optional<at::Tensor>>& lora_b,
                                       at::ArrayRef<double> scalings, std::vector<at::Tensor>& keep);

// fused_linear over prepared weights (the LoRA acts at `columns`; none where absent).
std::vector<at::Tensor> fused_linear_prepared(const at::Tensor& x, const std::vector<FusedWeight>& weights,
                                              const c10::optional<at::Tensor>& columns);

std::vector<at::Tensor> fused_linear(const at::Tensor& x, at::TensorList weights,
                                     const c10::List<c10::optional<at::Tensor>>& biases,
                                     const c10::List<c10::optional<at::Tensor>>& lora_a,
                                     const c10::List<c10::optional<at::Tensor>>& lora_b, at::ArrayRef<double> scalings,
                                     const c10::optional<at::Tensor>& columns);

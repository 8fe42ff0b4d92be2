// The small-M GEMM kernels of small_gemm.cpp, for the other sources of the same library.
#pragma once
#include <ATen/ATen.h>

#include <vector>

// The operator namespace (an A/B build loaded beside the real one renames it: -DMARS_NAMESPACE=...).
#ifndef MARS_NAMESPACE
#define MARS_NAMESPACE mars
#endif

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);

at::Tensor lowrank_linear(const at::Tensor& x, const at::Tensor& weight, c10::optional<int64_t> rows);

std::vector<at::Tensor> fused_linear(const at::Tensor& x, at::TensorList weights,
                                     const c10::List<c10::optional<at::Tensor>>& biases,
                                     const c10::List<c10::optional<at::Tensor>>& lora_a,
                                     const c10::List<c10::optional<at::Tensor>>& lora_b, at::ArrayRef<double> scalings,
                                     const c10::optional<at::Tensor>& columns);

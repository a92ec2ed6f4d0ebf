#include "ops/distillation_rows.h"

#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/logsumexp.h>

#include <cmath>
#include <cstdint>

#include "ops/cpu_vector.h"

namespace kvbound::ops {
namespace {

constexpr float kLog2e = 1.44269504088896341f;
constexpr int kLanes = 16;

// Pairwise sum of the lanes, as cpu::fixed_order_sum ends.
float add_lanes(float (&lane)[kLanes]) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
  return lane[0];
}

KVBOUND_VECTOR_CLONES float row_max(const float* z, int64_t V) {
  float lane[kLanes];
  for (float& l : lane) l = -INFINITY;
  const int64_t full = V - V % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) lane[j] = z[i + j] > lane[j] ? z[i + j] : lane[j];
  for (int64_t i = full; i < V; ++i) lane[i - full] = z[i] > lane[i - full] ? z[i] : lane[i - full];
  float m = lane[0];
  for (int j = 1; j < kLanes; ++j) m = lane[j] > m ? lane[j] : m;
  return m;
}

// e = exp(z − max) over the teacher row, written over it; returns Σ e, and Σ e·(z − z_s) into *cross (read
// before z is overwritten).
KVBOUND_VECTOR_CLONES float exponentiate_teacher(float* z, const float* z_s, int64_t V, float max, float* cross) {
  float sum[kLanes] = {}, dot[kLanes] = {};
  const int64_t full = V - V % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float e = cpu::exp2_nonpositive((z[i + j] - max) * kLog2e);
      dot[j] += e * (z[i + j] - z_s[i + j]);
      sum[j] += e;
      z[i + j] = e;
    }
  for (int64_t i = full; i < V; ++i) {
    const float e = cpu::exp2_nonpositive((z[i] - max) * kLog2e);
    dot[i - full] += e * (z[i] - z_s[i]);
    sum[i - full] += e;
    z[i] = e;
  }
  *cross = add_lanes(dot);
  return add_lanes(sum);
}

// e = exp(z − max) over the student row, written over it; returns Σ e.
KVBOUND_VECTOR_CLONES float exponentiate_student(float* z, int64_t V, float max) {
  float sum[kLanes] = {};
  const int64_t full = V - V % kLanes;
  for (int64_t i = 0; i < full; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float e = cpu::exp2_nonpositive((z[i + j] - max) * kLog2e);
      sum[j] += e;
      z[i + j] = e;
    }
  for (int64_t i = full; i < V; ++i) {
    const float e = cpu::exp2_nonpositive((z[i] - max) * kLog2e);
    sum[i - full] += e;
    z[i] = e;
  }
  return add_lanes(sum);
}

// diff = e_s·inv_s − e_t·inv_t and, when ps is given, ps = e_s·inv_s. In float32 ps may be e_t's own row (each
// lane reads e_t before it writes).
KVBOUND_VECTOR_CLONES void probabilities_f32(const float* e_t, const float* e_s, int64_t V, float inv_t, float inv_s,
                                             float* diff, float* ps) {
  if (ps == nullptr) {
#pragma omp simd
    for (int64_t i = 0; i < V; ++i) diff[i] = e_s[i] * inv_s - e_t[i] * inv_t;
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) {
    const float p_s = e_s[i] * inv_s, d = p_s - e_t[i] * inv_t;
    ps[i] = p_s;
    diff[i] = d;
  }
}

KVBOUND_VECTOR_CLONES void probabilities_bf16(const float* e_t, const float* e_s, int64_t V, float inv_t, float inv_s,
                                              uint16_t* diff, uint16_t* ps) {
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) diff[i] = cpu::float_to_bf16(e_s[i] * inv_s - e_t[i] * inv_t);
  if (ps == nullptr) return;
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) ps[i] = cpu::float_to_bf16(e_s[i] * inv_s);
}

void check(const at::Tensor& teacher, const at::Tensor& student, const at::Tensor& difference,
           const at::Tensor& student_probs) {
  TORCH_CHECK(teacher.dim() == 2 && student.sizes() == teacher.sizes() && teacher.scalar_type() == at::kFloat &&
                  student.scalar_type() == at::kFloat && teacher.stride(1) == 1 && student.stride(1) == 1,
              "distillation_rows: teacher and student must be float32 [n, V] logits with unit stride along V; got ",
              teacher.sizes(), " ", teacher.scalar_type(), " and ", student.sizes(), " ", student.scalar_type());
  TORCH_CHECK(difference.defined() || !student_probs.defined(),
              "distillation_rows: student_probs is written only beside the difference");
  for (const at::Tensor* out : {&difference, &student_probs}) {
    if (!out->defined()) continue;
    TORCH_CHECK(out->sizes() == teacher.sizes() && out->stride(1) == 1 &&
                    (out->scalar_type() == at::kFloat || out->scalar_type() == at::kBFloat16) &&
                    out->device() == teacher.device(),
                "distillation_rows: the probability outputs must be float32 or bfloat16 [n, V] on the logits' device, "
                "unit stride along V; got ", out->sizes(), " ", out->scalar_type());
  }
  TORCH_CHECK(student.device() == teacher.device(), "distillation_rows: teacher and student on different devices");
  TORCH_CHECK(!student_probs.defined() || student_probs.scalar_type() == difference.scalar_type(),
              "distillation_rows: difference and student_probs must share one dtype");
}

DistillationRows rows_cpu(const at::Tensor& teacher, const at::Tensor& student, const at::Tensor& difference,
                          const at::Tensor& student_probs) {
  const int64_t n = teacher.size(0), V = teacher.size(1);
  DistillationRows out{at::empty({n}, teacher.options()), at::empty({n}, teacher.options())};
  float* t = teacher.mutable_data_ptr<float>();
  float* s = student.mutable_data_ptr<float>();
  float* kl = out.kl.mutable_data_ptr<float>();
  float* lse = out.lse_student.mutable_data_ptr<float>();
  const bool bf16 = difference.scalar_type() == at::kBFloat16, probs = student_probs.defined();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* z_t = t + r * teacher.stride(0);
      float* z_s = s + r * student.stride(0);
      const float max_t = row_max(z_t, V), max_s = row_max(z_s, V);
      float cross = 0.f;
      const float sum_t = exponentiate_teacher(z_t, z_s, V, max_t, &cross);
      const float sum_s = exponentiate_student(z_s, V, max_s);
      const float lse_t = max_t + std::log(sum_t), lse_s = max_s + std::log(sum_s);
      kl[r] = cross / sum_t - lse_t + lse_s;
      lse[r] = lse_s;
      if (!difference.defined()) continue;
      if (bf16) {
        auto* d = static_cast<uint16_t*>(difference.mutable_data_ptr()) + r * difference.stride(0);
        auto* p = probs ? static_cast<uint16_t*>(student_probs.mutable_data_ptr()) + r * student_probs.stride(0) : nullptr;
        probabilities_bf16(z_t, z_s, V, 1.f / sum_t, 1.f / sum_s, d, p);
      } else {
        float* d = difference.mutable_data_ptr<float>() + r * difference.stride(0);
        float* p = probs ? student_probs.mutable_data_ptr<float>() + r * student_probs.stride(0) : nullptr;
        probabilities_f32(z_t, z_s, V, 1.f / sum_t, 1.f / sum_s, d, p);
      }
    }
  });
  return out;
}

// Σ_v a[r, v]·b[r, v] per row of two [n, V] blocks, without an [n, V] product tensor.
at::Tensor row_dot(const at::Tensor& a, const at::Tensor& b) {
  return at::bmm(a.unsqueeze(1), b.unsqueeze(2)).view({a.size(0)});
}

}  // namespace

DistillationRows distillation_rows(const at::Tensor& teacher, const at::Tensor& student, const at::Tensor& difference,
                                   const at::Tensor& student_probs) {
  check(teacher, student, difference, student_probs);
  return teacher.is_cpu() ? rows_cpu(teacher, student, difference, student_probs)
                          : distillation_rows_aten(teacher, student, difference, student_probs);
}

DistillationRows distillation_rows_aten(const at::Tensor& teacher, const at::Tensor& student,
                                        const at::Tensor& difference, const at::Tensor& student_probs) {
  check(teacher, student, difference, student_probs);
  const at::Tensor lse_t = at::logsumexp(teacher, 1), lse_s = at::logsumexp(student, 1);
  const at::Tensor p_t = (teacher - lse_t.unsqueeze(1)).exp_(), p_s = (student - lse_s.unsqueeze(1)).exp_();
  const at::Tensor kl = row_dot(p_t, teacher - student) - lse_t + lse_s;
  // Written last: difference may be the student's own buffer and student_probs the teacher's.
  if (difference.defined()) difference.copy_(p_s - p_t);
  if (student_probs.defined()) student_probs.copy_(p_s);
  return {kl, lse_s};
}

}  // namespace kvbound::ops

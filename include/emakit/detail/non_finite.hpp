// The skip_non_finite check (EmaOptions::skip_non_finite): the first source an update would read
// that holds a NaN or an infinity. Planned with the update (UpdateKernel), so that a check looks
// nothing up: sources on a device (or every source, on the foreach CPU path) are checked together,
// one _foreach_norm(inf) per (device, dtype) (a max-abs that cannot overflow) reduced to one flag
// on the device and read with one host sync; CPU sources of the fused path are scanned on the host.
#pragma once

#include <emakit/detail/config.hpp>
#include <emakit/detail/check.hpp>
#include <emakit/detail/update_plan.hpp>

#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/stack.h>
#include <c10/core/Device.h>
#include <c10/core/GradMode.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail {

class NonFiniteCheck {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  NonFiniteCheck() = default;
  // The sources a copying update (copying = true: every slot) or an averaging one (averaged slots
  // and copies that follow averages) reads, of a floating or complex dtype and not empty.
  NonFiniteCheck(const std::vector<Slot>& slots, bool copying, CpuPath cpu_path) {
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const Slot& s = slots[i];
      const auto type = s.source.scalar_type();
      const bool read = (copying || s.averaged || s.follows_averages) && s.source.numel() > 0 &&
                        (c10::isFloatingType(type) || c10::isComplexType(type));
      if (!read) continue;
      if (s.source.is_cpu() && cpu_path == CpuPath::fused) {
        scanned_.push_back(i);
        continue;
      }
      auto g = std::find_if(groups_.begin(), groups_.end(),
                            [&](const Group& x) { return x.device == s.source.device() && x.dtype == type; });
      if (g == groups_.end()) g = groups_.insert(groups_.end(), Group{s.source.device(), type, {}, {}});
      g->sources.push_back(s.source);
      g->slots.push_back(i);
    }
  }

  // The first planned slot, in slot order, whose source holds a NaN or an infinity; npos if none.
  // Only when something is found are the per-tensor flags read (one more sync per group), to name
  // the first.
  std::size_t first(const std::vector<Slot>& slots) const {
    std::size_t first = npos;  // of the host-scanned sources
    for (const std::size_t i : scanned_)
      if (!all_finite(slots[i].source)) {
        first = i;
        break;
      }
    if (groups_.empty()) return first;
    c10::NoGradGuard no_grad;
    std::vector<at::Tensor> finite;  // per group, per source
    at::Tensor all;                  // every source of every group is finite
    for (const auto& g : groups_) {
      finite.push_back(at::stack(at::_foreach_norm(g.sources, std::numeric_limits<double>::infinity())).isfinite());
      const at::Tensor f = finite.back().all();
      all = all.defined() ? all.logical_and(f.to(all.device())) : f;
    }
    if (all.item<bool>()) return first;
    for (std::size_t k = 0; k < groups_.size(); ++k) {
      const at::Tensor flags = finite[k].to(at::kCPU);
      const bool* ok = flags.data_ptr<bool>();
      const auto& group_slots = groups_[k].slots;
      for (std::size_t j = 0; j < group_slots.size(); ++j)
        if (!ok[j]) {
          first = std::min(first, group_slots[j]);
          break;
        }
    }
    return first;
  }

 private:
  struct Group {
    c10::Device device;
    c10::ScalarType dtype;
    std::vector<at::Tensor> sources;
    std::vector<std::size_t> slots;
  };
  std::vector<std::size_t> scanned_;
  std::vector<Group> groups_;
};

}  // namespace emakit::inline EMAKIT_ABI_NAMESPACE::detail

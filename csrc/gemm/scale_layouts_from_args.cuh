// A thin layer over CUTLASS 4.2's Hopper grouped FP8 blockwise mainloop that makes it read the per-group scale
// layouts it is given: the base rebuilds them with the packed stride ceil(M_g / granularity), but our activation
// scales are ONE (M, K/128) column-major tensor (column stride M, all tokens). Loads and math stay CUTLASS's.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace moe_fp8 {

template <class Base>
struct ScaleLayoutsFromArgs : Base {
  using Params = typename Base::Params;
  using ScaleLayoutA = typename Base::InternalLayoutSFA;  // one group's (scale_m, scale_k, l) layout
  using ScaleLayoutB = typename Base::InternalLayoutSFB;
  using ScaleElement = typename Base::ElementBlockScale;
  static_assert(Base::IsGroupedGemmKernel, "ScaleLayoutsFromArgs: per-group layouts are for grouped GEMMs");

  // The kernel calls this once for its first tile, with no group: the scale views are placeholders, replaced before
  // any load because the first tile always counts as a group change (tensors_perform_update).
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto load_init(ProblemShapeMNKL const& shape, Params const& params) const {
    return with_scales(shape, params, nullptr, ScaleLayoutA{}, nullptr, ScaleLayoutB{});
  }

  template <class InputTensors, class ProblemShapeMNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const&, Params const& params,
                                                     ProblemShapeMNKL shape, int32_t group) {
    return with_scales(shape, params, params.ptr_SFA[group], params.layout_SFA[group], params.ptr_SFB[group],
                       params.layout_SFB[group]);
  }

 private:
  template <class ProblemShapeMNKL>
  CUTLASS_DEVICE auto with_scales(ProblemShapeMNKL const& shape, Params const& params, ScaleElement const* sfa,
                                  ScaleLayoutA layout_sfa, ScaleElement const* sfb, ScaleLayoutB layout_sfb) const {
    // The base's A and B views (TMA coordinate tensors); its scale views are dropped.
    auto base = Base::load_init(shape, params);
    return cute::make_tuple(cute::get<0>(base), cute::get<1>(base),
                            cute::make_tensor(cute::make_gmem_ptr(sfa), layout_sfa),
                            cute::make_tensor(cute::make_gmem_ptr(sfb), layout_sfb));
  }
};

}  // namespace moe_fp8

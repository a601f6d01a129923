// The private tuning table: process-wide overrides of launch choices, for tests and
// sweeps (moe_fp8_ext/_tuning.py; docs/TUNING.md). Unset means the library's own choice;
// a value is parsed where it is used, with the syntax the table in docs/TUNING.md gives.
#pragma once

#include <optional>
#include <string>

namespace moe_fp8 {

enum class Knob : int {
  kColsPlan,       // "cluster,rows": launch plan of the transposing kernels
  kColsBlockPlan,  // "slices,rows": the same in block mode
  kRowsGather,     // "0"/"1": blockwise act_lhs gathers scales over a cluster
  kRowsRuns,       // "0"/"1": the same op stores 8-row runs of scales
  kRowsDynamic,    // "0": MXFP8 blocked rowwise walks by a fixed stride
  kDualL2Bytes,    // "l2", a byte count or "0": L2 budget of the one-read dual kernel
  kCount
};

// The name Python uses for `knob` (e.g. "cols_plan").
const char* knob_name(Knob knob);

// The override of `knob`, nullopt where unset. Lock-free while the knob is unset, so
// launchers may ask on every launch; thread-safe.
std::optional<std::string> tuning(Knob knob);

// A 0/1 knob: -1 unset or empty, 0 for a value starting with '0', 1 otherwise.
int tuning_switch(Knob knob);

// Sets the knob named `name` (nullopt: unsets it), from the next launch on, and returns
// its previous value; an unknown name throws std::invalid_argument("expected one of ...").
std::optional<std::string> set_tuning(const std::string& name, const std::optional<std::string>& value);

// The value of the knob named `name` (nullopt: unset); an unknown name throws.
std::optional<std::string> get_tuning(const std::string& name);

}  // namespace moe_fp8

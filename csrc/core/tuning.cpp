// The private tuning table (tuning.h): one slot a knob behind a mutex, with a flag a
// knob that launchers read without the lock while it is unset.
#include "tuning.h"

#include <atomic>
#include <mutex>
#include <stdexcept>

namespace moe_fp8 {
namespace {

constexpr int kKnobs = static_cast<int>(Knob::kCount);
constexpr const char* kNames[kKnobs] = {"cols_plan", "cols_block_plan", "rows_gather",
                                        "rows_runs", "rows_dynamic",    "dual_l2_bytes"};

struct Table {
  std::mutex mu;
  std::atomic<bool> set[kKnobs] = {};
  std::optional<std::string> value[kKnobs];
};

Table& table() {
  static Table t;  // built on first use: no static-initialization order to depend on
  return t;
}

int knob_index(const std::string& name) {
  for (int i = 0; i < kKnobs; ++i) {
    if (name == kNames[i]) return i;
  }
  std::string names;
  for (int i = 0; i < kKnobs; ++i) names += (i > 0 ? ", " : "") + std::string(kNames[i]);
  throw std::invalid_argument("moe_fp8 tuning: expected one of " + names + ", got \"" + name + "\"");
}

}  // namespace

const char* knob_name(Knob knob) { return kNames[static_cast<int>(knob)]; }

std::optional<std::string> tuning(Knob knob) {
  Table& t = table();
  const int i = static_cast<int>(knob);
  if (!t.set[i].load(std::memory_order_acquire)) return std::nullopt;
  std::lock_guard<std::mutex> lock(t.mu);
  return t.value[i];
}

int tuning_switch(Knob knob) {
  const std::optional<std::string> v = tuning(knob);
  return !v || v->empty() ? -1 : ((*v)[0] == '0' ? 0 : 1);
}

std::optional<std::string> set_tuning(const std::string& name, const std::optional<std::string>& value) {
  const int i = knob_index(name);
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  std::optional<std::string> previous = t.value[i];
  t.value[i] = value;
  t.set[i].store(value.has_value(), std::memory_order_release);
  return previous;
}

std::optional<std::string> get_tuning(const std::string& name) {
  const int i = knob_index(name);
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mu);
  return t.value[i];
}

}  // namespace moe_fp8

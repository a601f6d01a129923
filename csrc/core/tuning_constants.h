// The measured constants of the launch heuristics, each with its reason and the decision
// record with its numbers (docs/decisions/NNN-*.md). They change only the speed, never the
// bits. Run-time overrides for sweeps: tuning.h.
#pragma once

#include <cstdint>

namespace moe_fp8 {

// ---- rows kernels (quant/rows_kernel.cuh) -------------------------------------------
constexpr int kRowsStages = 2;          // ring of row buffers: deeper rings lost to more blocks an SM (030)
constexpr int kRowsVecsPerThread = 8;   // 16-byte vectors a thread and row: best of 2/4/8 (030)
constexpr int64_t kGatherMinRowBytes = 8192;  // cluster scale gather pays from rows of 4096 bf16 (030)
constexpr int64_t kGatherMinSteps = 8;        // ... and with at least 8 steps a cluster (030)
constexpr int64_t kRunMinRowBytes = 4096;     // 8-row scale runs pay from rows of 2048 16-bit elements (030)
constexpr int64_t kRunMinRuns = 2;            // ... and with at least 2 runs a resident block (030)
constexpr int kTileSliceBytes = 1024;   // octet-tile unit: one slice of input a row; 512, 2048 no better (030)
constexpr int kTileMGroupBlocksPerSm = 6;         // M-group octet-tile grid where padding <= 1/8 of rows (023)
constexpr double kTileRefBytesPerNsPerSm = 25.4;  // H100 SXM DRAM bytes/ns an SM: the 6's reference (024)

// ---- cols kernels (quant/cols_kernel.cuh) -------------------------------------------
constexpr int64_t kColsSmemBudget = 72 * 1024;   // whole-set slice cache: the most that keeps 3 blocks an SM (030)
constexpr int64_t kColsLongSliceRows = 768;      // long segments cache this many rows, or a whole SM at 2x (030)
constexpr int64_t kColsBlockSliceRows = 512;     // block-mode slice (001)
constexpr int64_t kColsBlockCacheRows = 384;     // block-mode rows staged at a time (001)
constexpr int64_t kColsGroupSlicesMaxTiles = 32;  // group slices only for narrow operands; 5120+ cols lost (027)

// ---- one-read weight dual (quant/specialized/dual_kernel.cuh, rowwise/rowwise.cu) ----
constexpr int kDualL2Fifths = 3;  // default L2 budget: 3/5 of L2, two experts' reads kept (DESIGN §5)

}  // namespace moe_fp8

// The split path and the eval-mode sweep (instance_norm_split.cu), for the path
// chooser in instance_norm_forward.cu.
#pragma once

#include "instance_norm.h"

namespace instance_norm {

// Whether the split path can run this problem (any GPU, layout and alignment;
// spatial and num_channels below 2^30 so per-element index splits fit 32 bits).
bool split_supported(const ForwardProblem& problem);

// The split path's plan (path kSplit, its launches in plan.split): the workspace
// holds the per-chunk partial statistics (none with running statistics), then one
// float4 {shift, mean, rstd * weight, bias} per slice.
ForwardPlan split_plan(const ForwardProblem& problem);

// Partial statistics per chunk (first read), their combination per slice, then the
// normalize sweep (second read); with running_mean set, the per-slice values come
// from the running statistics and the sweep is the only read.
cudaError_t launch_split(const ForwardProblem& problem, const SplitPlan& plan, cudaStream_t stream);

}  // namespace instance_norm

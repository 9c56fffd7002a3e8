// The pipelined path (instance_norm_pipelined.cu), for the path chooser in
// instance_norm_forward.cu.
#pragma once

#include "instance_norm.h"

namespace instance_norm {

// The pipelined path's plan: teams of team_size CTAs, each taking up to `rounds`
// slices one after another (the other teams one fewer at most), the workspace their
// arrival counters and the CTA totals of the rounds in flight. Invalid where the path
// cannot run: it needs sm_90+, the contiguous layout, whole 16-byte vectors at
// 16-byte aligned x and y, and a team no larger than the CTAs resident at once; and
// for an empty problem (no slices or no values), which needs no kernel.
ForwardPlan pipelined_plan(const ForwardProblem& problem);

// Values of a slice one CTA of the pipelined path holds.
int64_t pipelined_cta_capacity(DType dtype);

}  // namespace instance_norm

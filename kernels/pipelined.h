// The pipelined path (instance_norm_pipelined.cu), for the path chooser in
// instance_norm_forward.cu.
#pragma once

#include "instance_norm.h"

namespace instance_norm {

// How the pipelined path runs a problem: teams of team_size CTAs, each taking up to
// `rounds` slices one after another (the other teams one fewer at most). teams == 0
// where the path cannot run: it needs sm_90+, the contiguous layout, whole 16-byte
// vectors at 16-byte aligned x and y, and a team no larger than the CTAs resident at
// once; and for an empty problem (no slices or no values), which needs no kernel.
struct PipelinedPlan {
  int team_size;
  int64_t teams;
  int64_t rounds;
};
PipelinedPlan pipelined_plan(const ForwardProblem& problem);

// Workspace of launch_pipelined: per team, arrival counters and the CTA totals of
// the rounds in flight.
size_t pipelined_workspace_bytes(const ForwardProblem& problem);

// Runs the forward on the pipelined path; only where pipelined_plan(problem).teams > 0.
cudaError_t launch_pipelined(const ForwardProblem& problem, cudaStream_t stream);

}  // namespace instance_norm

// The tuner's steps and the helpers they share (tools/planner/tune*.cpp; Note [Tuner] in
// tune.cpp). Internal to the planner: tune.h is the interface.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "tools/planner/tune.h"

namespace tetra::planner::tuning {

using Clock = std::chrono::steady_clock;

// Progress, flushed at once; nothing when `out` is null.
__attribute__((format(printf, 2, 3))) void say(std::FILE* out, const char* format, ...);
std::string clock_text(double seconds);  // "1:05"
std::string ms(double seconds);          // "12.34", "-" below 0

// Two rounds of one trial agree when the slower is within this factor of the faster;
// otherwise the trial gets a third round (Note [Tuner]).
constexpr double kRoundsAgree = 1.10;
// How far a trial's slowest round was from its fastest (0.3: 30% slower); 0 for one round.
double spread_of(const std::vector<double>& rounds);
bool rounds_agree(const std::vector<double>& rounds);
double median(std::vector<double> v);  // NaN when empty

// The prediction's terms under the names a trial's measured phases have.
std::map<std::string, double> predicted_phases(const StepPrediction& p);
// measured / predicted per phase, the geometric mean over the trials that measured both.
std::map<std::string, double> phase_ratios(const std::vector<Candidate>& cs);
std::string ratios_text(const std::map<std::string, double>& r);

// The memory one process may hold: --memory-gb, else the host's shared by its processes
// (a job on cuda: its device's, where this host has one).
int64_t memory_limit(const TuneOptions& o, const core::JobSpec& spec);

// A trial: the candidate's job made short and quiet in `dir`, started by `launcher`,
// its outcome and its run folder's figures in `c`.
void run_trial(Candidate& c, const TuneOptions& o, TrialLauncher& launcher, const std::string& dir,
               double seconds_left);
// The log's line that says what went wrong: the last "error" line, else the last line.
std::string failure_line(const std::string& log);

// The chosen job as written: a header that says how it was chosen, then its YAML.
std::string written_job(const TuneResult& r, const TuneOptions& o, const std::string& launcher);

}  // namespace tetra::planner::tuning

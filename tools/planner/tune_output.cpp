// What the tuner writes (Note [Tuner]): the table of its candidates, and the chosen job
// with a header that says how it was chosen and what it measured.
#include "tools/planner/tune_steps.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <ctime>

#include "collectives/build_config.h"
#include "core/job_spec.h"
#include "core/text.h"
#include "hardware/topology.h"

namespace tetra::planner {

using namespace tetra::core;

using hardware::ByteDigits;
using hardware::format_bytes;

namespace tuning {

namespace {

std::string command_line(const TuneOptions& o) {
  std::string s = "train " + o.job;
  for (const auto& x : o.sets) s += " --set " + x;
  s += " --tune --np " + std::to_string(o.np);
  if (o.ranks_per_host > 0) s += " --ranks-per-host " + std::to_string(o.ranks_per_host);
  if (o.memory_gb > 0) s += " --memory-gb " + fmt("%g", o.memory_gb);
  if (o.dry_run) s += " --dry-run";
  return s;
}

}  // namespace

std::string written_job(const TuneResult& r, const TuneOptions& o, const std::string& launcher) {
  const Candidate& c = r.candidates[static_cast<size_t>(r.chosen)];
  std::string h;
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  int priced = 0, fits = 0;
  for (const Candidate& x : r.candidates) {
    priced += x.priced && x.invalid.empty();
    fits += x.priced && x.invalid.empty() && x.pruned.empty();
  }
  h += "# Chosen by `" + command_line(o) + "` (tetra " + TETRA_VERSION +
       (*TETRA_GIT_COMMIT ? std::string(", commit ") + TETRA_GIT_COMMIT : std::string()) + ", " + when + "):\n";
  h += fmt("#   %zu candidates, %d priced valid by the cost model, %d within %s a process; ", r.candidates.size(), priced,
           fits, format_bytes(r.memory_limit, ByteDigits::kWhole).c_str());
  h += o.dry_run ? std::string("on paper (--dry-run): no trial run") :
                   fmt("%d measured in trials of %d steps after %d of warm-up%s", r.trials_run, o.trial_steps,
                       o.warmup_steps, launcher.empty() ? "" : (" under `" + launcher + "`").c_str());
  h += r.out_of_budget ? "; the budget ran out first.\n" : ".\n";
  h += "#   priced with: " + r.calibration + "\n";
  h += "#   this job: " + c.label + "\n";
  if (c.trial == Candidate::Trial::kOk) {
    std::string rounds = std::to_string(std::max<size_t>(1, c.rounds.size())) + " round" + (c.rounds.size() > 1 ? "s" : "");
    if (c.rounds.size() > 1) rounds += fmt(", %.0f%% apart", 100 * spread_of(c.rounds));
    h += "#   measured " + ms(c.measured_s) + " ms a step (the mean of " + rounds + "; predicted " + ms(c.predicted_s) + "), peak RSS " +
         format_bytes(c.measured_rss, ByteDigits::kWhole) + " on its largest rank (model state " +
         format_bytes(c.measured_state, ByteDigits::kWhole) + "; predicted state and activations " +
         format_bytes(c.predicted_bytes, ByteDigits::kWhole) + ")\n";
    for (const Candidate& x : r.candidates)
      if (x.as_given && x.trial == Candidate::Trial::kOk && &x != &c)
        h += "#   the job as given measured " + ms(x.measured_s) + " ms a step: this one trains " +
             fmt("%.2f", x.measured_s / c.measured_s) + "x as fast\n";
  } else {
    h += "#   not measured (" + std::string(o.dry_run ? "--dry-run: on paper" : "no trial finished") +
         "): predicted " + ms(c.predicted_s) + " ms a step, " + format_bytes(c.predicted_bytes, ByteDigits::kWhole) +
         " on its largest rank\n";
  }
  if (r.trials_run >= 3)
    h += "#   predicted against measured step over the trials: rank correlation " + fmt("%.2f", r.correlation) + "\n";
  if (!r.phase_ratios.empty())
    h += "#   measured / predicted per phase (geometric mean over the trials): " + ratios_text(r.phase_ratios) + "\n";
  // Its own run: named <name>-tuned, so that running it starts a run folder of its own
  // (runs/<name>-tuned) and never continues the job's (Note [A finished run stays]).
  YAML::Node job = YAML::Load(c.yaml);
  const std::string name = c.spec.name + "-tuned";
  job["name"] = name;
  std::string folder = "runs/" + name + " (log.dir unset: it follows the name)";
  if (job["log"] && job["log"]["dir"] && !job["log"]["dir"].IsNull() && !job["log"]["dir"].as<std::string>().empty()) {
    folder = job["log"]["dir"].as<std::string>() + "-tuned";  // the user's own folder, beside it
    job["log"]["dir"] = folder;
  }
  h += "#   named " + name + ": its run folder is " + folder + ", beside the job's own\n";
  return h + resolved_yaml(job);
}

}  // namespace tuning

using namespace tuning;

std::string TuneResult::table() const {
  std::string out;
  // The measured, in the order they ran, then the best on paper not measured.
  std::vector<int> rows = order;
  if (!candidates.empty() && candidates.front().as_given && candidates.front().trial == Candidate::Trial::kNotRun &&
      candidates.front().priced)
    rows.push_back(0);
  const int on_paper = trials_run ? 5 : 12;
  std::vector<int> paper = trial_order(candidates, on_paper + static_cast<int>(rows.size()));
  int shown = 0;
  for (int i : paper)
    if (candidates[i].trial == Candidate::Trial::kNotRun && shown < on_paper) rows.push_back(i), ++shown;
  int width = 9;
  for (int i : rows) width = std::max(width, static_cast<int>(candidates[static_cast<size_t>(i)].label.size()));
  out += fmt("  %-4s %-*s %9s %9s %6s %-14s %9s %9s %9s  %s\n", "#", width, "candidate", "pred ms", "meas ms", "ratio",
             "rounds", "pred mem", "peak RSS", "state", "trial");
  for (int i : rows) {
    const Candidate& c = candidates[static_cast<size_t>(i)];
    const bool ok = c.trial == Candidate::Trial::kOk;
    // Each trial's spread: its rounds, and how far apart the extremes are.
    std::string spread = "-";
    if (ok && !c.rounds.empty())
      spread = std::to_string(c.rounds.size()) +
               (c.rounds.size() == 1 ? " round" : fmt(" rounds, %.0f%%", 100 * spread_of(c.rounds)));
    out += fmt("  %-4d %-*s %9s %9s %6s %-14s %9s %9s %9s  %s%s\n", i, width, c.label.c_str(), ms(c.predicted_s).c_str(),
               ok ? ms(c.measured_s).c_str() : "-", ok ? fmt("%.2f", c.measured_s / c.predicted_s).c_str() : "-",
               spread.c_str(),
               format_bytes(c.predicted_bytes, ByteDigits::kWhole).c_str(),
               c.measured_rss ? format_bytes(c.measured_rss, ByteDigits::kWhole).c_str() : "-",
               c.measured_state ? format_bytes(c.measured_state, ByteDigits::kWhole).c_str() : "-",
               c.trial == Candidate::Trial::kNotRun ? "on paper" : to_string(c.trial).c_str(),
               i == chosen ? "  <- chosen" : c.failure.empty() ? "" : ("  (" + c.failure + ")").c_str());
  }
  out += "  (meas ms: the mean of its rounds; rounds: how many, and how far the slowest was from the fastest (a third "
         "when two differ by more than 10%); pred mem: the largest process's model state and activations, the dry "
         "run's estimate; peak RSS: what the kernel counted on the largest rank; state: the model state the run "
         "counted there)\n";
  if (!phase_ratios.empty())
    out += "  (per phase, measured / predicted: compute, optimizer and loading on the rank with the most compute; comm "
           "AXIS the axis's ops' busy time, overlap with compute included, against their predicted time; bubble a "
           "pipeline's idle wait against its fill, drain and transfers)\n";
  if (trials_run >= 3)
    out += "  rank correlation of predicted and measured step: " + fmt("%.2f", correlation) + " over " +
           std::to_string(trials_run) + " trials\n";
  if (!phase_ratios.empty()) out += "  measured / predicted per phase: " + ratios_text(phase_ratios) + "\n";
  return out;
}

}  // namespace tetra::planner

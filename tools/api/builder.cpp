#include "tetra/builder.h"

#include "core/job_file.h"
#include "tetra/tetra.h"

namespace tetra {

namespace {

// One value in flow style, as it would be written in a job file.
std::string flow(const YAML::Node& value) {
  YAML::Emitter out;
  out << YAML::Flow << value;
  return out.c_str();
}

}  // namespace

PlanBuilder::PlanBuilder(std::string name, const core::SectionRegistry* plugins)
    : name_(std::move(name)), plugins_(plugins) {
  if (!plugins_) {
    builtin_ = std::make_shared<core::SectionRegistry>();
    register_builtin_plugins(*builtin_);
    plugins_ = builtin_.get();
  }
}

PlanBuilder& PlanBuilder::add(std::string call, std::string section, YAML::Node values) {
  for (Call& c : calls_)
    if (c.section == section) {
      c = Call{std::move(call), std::move(section), std::move(values)};
      return *this;
    }
  calls_.push_back(Call{std::move(call), std::move(section), std::move(values)});
  return *this;
}

PlanBuilder& PlanBuilder::model(const core::ModelSpec& spec) { return add("PlanBuilder::model()", "model", core::to_yaml(spec)); }
PlanBuilder& PlanBuilder::data(const core::DataSpec& spec) { return add("PlanBuilder::data()", "data", core::to_yaml(spec)); }
PlanBuilder& PlanBuilder::optimizer(const core::OptimizerSpec& spec) {
  return add("PlanBuilder::optimizer()", "optimizer", core::to_yaml(spec));
}
PlanBuilder& PlanBuilder::schedule(const core::ScheduleSpec& spec) {
  return add("PlanBuilder::schedule()", "schedule", core::to_yaml(spec));
}
PlanBuilder& PlanBuilder::train(const core::TrainSpec& spec) { return add("PlanBuilder::train()", "train", core::to_yaml(spec)); }
PlanBuilder& PlanBuilder::checkpoint(const core::CheckpointSpec& spec) {
  return add("PlanBuilder::checkpoint()", "checkpoint", core::to_yaml(spec));
}
PlanBuilder& PlanBuilder::log(const core::LogSpec& spec) { return add("PlanBuilder::log()", "log", core::to_yaml(spec)); }
PlanBuilder& PlanBuilder::collectives(const core::CollectivesSpec& spec) {
  return add("PlanBuilder::collectives()", "collectives", core::to_yaml(spec));
}

PlanBuilder& PlanBuilder::mesh(const MeshOptions& mesh) {
  YAML::Node n(YAML::NodeType::Map);
  if (mesh.pipeline != 1) n["pipeline"] = mesh.pipeline;
  if (mesh.data != 1) n["data"] = mesh.data;
  if (mesh.tensor != 1) n["tensor"] = mesh.tensor;
  return add("PlanBuilder::mesh()", "mesh", n);
}

PlanBuilder& PlanBuilder::data_parallel(const data_parallel::Options& options) {
  return add("PlanBuilder::data_parallel()", "data_parallel", options.to_yaml());
}
PlanBuilder& PlanBuilder::pipeline(const pipeline::Options& options) {
  return add("PlanBuilder::pipeline()", "pipeline", options.to_yaml());
}
PlanBuilder& PlanBuilder::zero(const zero::Options& options) { return add("PlanBuilder::zero()", "zero", options.to_yaml()); }
PlanBuilder& PlanBuilder::replicate(const replicate::Options& options) {
  return add("PlanBuilder::replicate()", "replicate", options.to_yaml());
}
PlanBuilder& PlanBuilder::tensor_parallel(const tensor_parallel::Options& options) {
  return add("PlanBuilder::tensor_parallel()", "tensor", options.to_yaml());
}
PlanBuilder& PlanBuilder::strategy(const std::string& section, const core::StrategyConfig& options) {
  return add("PlanBuilder::strategy(\"" + section + "\")", section, options.to_yaml());
}

PlanBuilder& PlanBuilder::set(const std::string& assignment) {
  sets_.push_back(assignment);
  return *this;
}

std::string PlanBuilder::write(std::vector<std::string>* line_calls) const {
  std::string out;
  auto line = [&](const std::string& text, const std::string& call) {
    out += text + "\n";
    if (line_calls) line_calls->push_back(call);
  };
  line("name: " + flow(YAML::Node(name_)), "PlanBuilder(\"" + name_ + "\")");
  for (const Call& c : calls_) {
    if (!c.values.IsMap() || c.values.size() == 0) {
      line(c.section + ": {}", c.call);
      continue;
    }
    line(c.section + ":", c.call);
    for (auto it = c.values.begin(); it != c.values.end(); ++it)
      line("  " + it->first.as<std::string>() + ": " + flow(it->second), c.call);
  }
  return out;
}

std::string PlanBuilder::yaml() const { return write(nullptr); }

core::JobSpec PlanBuilder::build() const {
  std::vector<std::string> line_calls;
  const std::string text = write(&line_calls);
  core::ParsedJob parsed = core::parse_job_string(text, "PlanBuilder", sets_, *plugins_, [&](int line) {
    return line >= 1 && static_cast<size_t>(line) <= line_calls.size() ? line_calls[static_cast<size_t>(line - 1)]
                                                                       : std::string("PlanBuilder");
  });
  return std::move(parsed.spec);
}

}  // namespace tetra

// The job-spec reader and the job schema: every bad input gets one compiler-style line
// (file:line:col: error: path: what), all of a file's errors at once, never a crash.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/config.h"
#include "collectives/error.h"
#include "core/job_file.h"
#include "core/job_spec.h"

namespace tetra::core {
namespace {

const SectionRegistry kNoPlugins;

// The ConfigError's message for a job that must fail.
std::string errors_of(const std::string& yaml, const std::vector<std::string>& overrides = {},
                      const SectionRegistry& plugins = kNoPlugins) {
  try {
    parse_job_string(yaml, "job.yaml", overrides, plugins);
  } catch (const tetra::ConfigError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a ConfigError: " << e.what();
    return "";
  }
  ADD_FAILURE() << "the job parsed, but it should not have:\n" << yaml;
  return "";
}

JobSpec parse(const std::string& yaml, const std::vector<std::string>& overrides = {},
              const SectionRegistry& plugins = kNoPlugins) {
  return parse_job_string(yaml, "job.yaml", overrides, plugins).spec;
}

std::string temp_file(const std::string& name, const std::string& text) {
  std::filesystem::path dir = std::filesystem::path(testing::TempDir()) / "tetra_test_config";
  std::filesystem::create_directories(dir);
  std::filesystem::path p = dir / name;
  std::ofstream(p) << text;
  return p.string();
}

// ---- types ---------------------------------------------------------------------------

TEST(ConfigTypes, NumberGivenAWordNamesLineAndColumn) {
  EXPECT_EQ(errors_of("optimizer:\n  lr: fast\n"),
            "job.yaml:2:7: error: optimizer.lr: expected a number, got \"fast\"");
}

TEST(ConfigTypes, NumberRejectsListsMapsAndBooleans) {
  EXPECT_EQ(errors_of("optimizer:\n  lr: [1, 2]\n"),
            "job.yaml:2:7: error: optimizer.lr: expected a number, got a list");
  EXPECT_EQ(errors_of("optimizer:\n  lr: {a: 1}\n"),
            "job.yaml:2:7: error: optimizer.lr: expected a number, got a mapping");
  EXPECT_EQ(errors_of("optimizer:\n  lr: true\n"),
            "job.yaml:2:7: error: optimizer.lr: expected a number, got true");
}

TEST(ConfigTypes, NumberAcceptsIntegersFloatsAndExponents) {
  EXPECT_DOUBLE_EQ(parse("optimizer:\n  lr: 1e-3\n").optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(parse("optimizer:\n  lr: 0.001\n").optimizer.lr, 0.001);
  EXPECT_DOUBLE_EQ(parse("optimizer:\n  lr: 3\n").optimizer.lr, 3.0);
  EXPECT_DOUBLE_EQ(parse("optimizer:\n  lr: 2.5E-4\n").optimizer.lr, 2.5e-4);
}

TEST(ConfigTypes, IntegerRejectsAFraction) {
  EXPECT_EQ(errors_of("train:\n  epochs: 2.5\n"),
            "job.yaml:2:11: error: train.epochs: expected an integer, got 2.5");
  EXPECT_EQ(errors_of("train:\n  epochs: three\n"),
            "job.yaml:2:11: error: train.epochs: expected an integer, got \"three\"");
}

TEST(ConfigTypes, IntegerOutOfRange) {
  EXPECT_EQ(errors_of("train:\n  epochs: 0\n"),
            "job.yaml:2:11: error: train.epochs: must be >= 1, got 0");
  EXPECT_EQ(errors_of("optimizer:\n  lr: -0.1\n"),
            "job.yaml:2:7: error: optimizer.lr: must be > 0, got -0.1");
  EXPECT_EQ(errors_of("optimizer:\n  weight_decay: -1\n"),
            "job.yaml:2:17: error: optimizer.weight_decay: must be >= 0, got -1");
}

TEST(ConfigTypes, BooleanAcceptsTrueFalseYesNo) {
  EXPECT_FALSE(parse("data:\n  shuffle: false\n").data.shuffle);
  EXPECT_FALSE(parse("data:\n  shuffle: no\n").data.shuffle);
  EXPECT_TRUE(parse("data:\n  shuffle: yes\n").data.shuffle);
  EXPECT_EQ(errors_of("data:\n  shuffle: 1\n"),
            "job.yaml:2:12: error: data.shuffle: expected true or false, got 1");
}

TEST(ConfigTypes, ChoiceSuggestsTheNearest) {
  EXPECT_EQ(errors_of("optimizer:\n  type: adamm\n"),
            "job.yaml:2:9: error: optimizer.type: expected one of sgd, adam, adamw, got "
            "\"adamm\"; did you mean \"adam\"?");
  EXPECT_EQ(errors_of("optimizer:\n  type: rmsprop\n"),
            "job.yaml:2:9: error: optimizer.type: expected one of sgd, adam, adamw, got "
            "\"rmsprop\"");
}

TEST(ConfigTypes, ListOfIntegersPointsAtTheBadItem) {
  EXPECT_EQ(errors_of("model:\n  hidden: [64, 0]\n"),
            "job.yaml:2:16: error: model.hidden[1]: must be >= 1, got 0");
  EXPECT_EQ(errors_of("model:\n  hidden: 64\n"),
            "job.yaml:2:11: error: model.hidden: expected a list of integers, got 64 (write [64])");
}

TEST(ConfigTypes, SectionThatIsNotAMapping) {
  EXPECT_EQ(errors_of("optimizer: 3\n"),
            "job.yaml:1:12: error: optimizer: expected a mapping (key: value lines), got 3");
}

TEST(ConfigTypes, NullReadsAsTheDefault) {
  JobSpec spec = parse("optimizer:\n  lr:\n  type: ~\nmodel:\n");
  EXPECT_DOUBLE_EQ(spec.optimizer.lr, 1e-3);
  EXPECT_EQ(spec.optimizer.type, "adamw");
}

TEST(ConfigTypes, NullMaxStepsIsUnset) {
  EXPECT_FALSE(parse("train:\n  max_steps: null\n").train.max_steps.has_value());
  EXPECT_FALSE(parse("train:\n  max_steps: ~\n").train.max_steps.has_value());
  EXPECT_FALSE(parse("train:\n  epochs: 2\n").train.max_steps.has_value());
  EXPECT_EQ(parse("train:\n  max_steps: 100\n").train.max_steps, 100);
  EXPECT_EQ(errors_of("train:\n  max_steps: 0\n"),
            "job.yaml:2:14: error: train.max_steps: must be >= 1, got 0");
  ParsedJob job = parse_job_string("train:\n  max_steps: null\n", "job.yaml", {}, kNoPlugins);
  EXPECT_TRUE(job.resolved["train"]["max_steps"].IsNull());
  EXPECT_NE(resolved_yaml(job.resolved).find("max_steps: ~"), std::string::npos);
}

// ---- unknown keys -----------------------------------------------------------------------

TEST(ConfigKeys, MisspeltSectionSuggestsTheSection) {
  EXPECT_EQ(errors_of("optimiser:\n  lr: 0.1\n"),
            "job.yaml:1:1: error: optimiser: unknown section; did you mean \"optimizer\"?");
  EXPECT_EQ(errors_of("Optimizer:\n  lr: 0.1\n"),
            "job.yaml:1:1: error: Optimizer: unknown section; did you mean \"optimizer\"?");
}

TEST(ConfigKeys, MisspeltKeySuggestsTheKey) {
  EXPECT_EQ(errors_of("optimizer:\n  lrr: 0.1\n"),
            "job.yaml:2:3: error: optimizer.lrr: unknown key; did you mean \"lr\"?");
  EXPECT_EQ(errors_of("train:\n  epoch: 3\n"),
            "job.yaml:2:3: error: train.epoch: unknown key; did you mean \"epochs\"?");
}

TEST(ConfigKeys, UnknownKeyWithNothingNearListsTheKnownKeys) {
  EXPECT_EQ(errors_of("train:\n  colour: blue\n"),
            "job.yaml:2:3: error: train.colour: unknown key (known keys: epochs, max_steps, "
            "eval_every, seed, threads, precision, device, accumulation_steps, on_nonfinite, recompute)");
}

TEST(ConfigKeys, UnknownSectionListsCoreAndPluginSections) {
  SectionRegistry plugins;
  plugins.add("zero", [](Section& s, const JobSpec&) -> std::shared_ptr<const PluginConfig> {
    s.finish();
    return nullptr;
  });
  EXPECT_EQ(errors_of("colourful: 1\n", {}, plugins),
            "job.yaml:1:1: error: colourful: unknown section (known sections: name, model, data, "
            "optimizer, schedule, train, checkpoint, log, mesh, collectives, zero)");
}

TEST(ConfigKeys, KeyOfAnotherModelTypeSaysWhichType) {
  EXPECT_EQ(errors_of("model:\n  type: mlp\n  channels: [8]\n"),
            "job.yaml:3:3: error: model.channels: unknown key for model type mlp (channels is "
            "for cnn)");
  EXPECT_EQ(errors_of("optimizer:\n  type: adamw\n  momentum: 0.9\n"),
            "job.yaml:3:3: error: optimizer.momentum: unknown key for optimizer type adamw "
            "(momentum is for sgd)");
}

TEST(ConfigKeys, DuplicateKey) {
  EXPECT_EQ(errors_of("train:\n  epochs: 2\n  epochs: 3\n"),
            "job.yaml:3:3: error: train.epochs: duplicate key (first given at line 2)");
}

TEST(ConfigKeys, NearestUsesEditDistanceAndCase) {
  EXPECT_EQ(nearest("lrr", {"type", "lr", "eps"}), "lr");
  EXPECT_EQ(nearest("optimiser", {"model", "optimizer"}), "optimizer");
  EXPECT_EQ(nearest("LR", {"type", "lr"}), "lr");
  EXPECT_EQ(nearest("ecpohs", {"epochs", "seed"}), "epochs");
  EXPECT_EQ(nearest("warmup", {"type", "warmup_steps"}), "warmup_steps");
  EXPECT_EQ(nearest("colour", {"epochs", "seed", "threads"}), "");
  EXPECT_EQ(nearest("x", {}), "");
}

// ---- several errors ---------------------------------------------------------------------

TEST(ConfigErrors, EveryErrorAtOnceInLineOrder) {
  const std::string yaml =
      "train:\n"
      "  epochs: 0\n"
      "  precison: bf16\n"
      "optimizer:\n"
      "  type: adamm\n"
      "  lr: fast\n"
      "modle:\n"
      "  type: mlp\n";
  EXPECT_EQ(errors_of(yaml),
            "job.yaml:2:11: error: train.epochs: must be >= 1, got 0\n"
            "job.yaml:3:3: error: train.precison: unknown key; did you mean \"precision\"?\n"
            "job.yaml:5:9: error: optimizer.type: expected one of sgd, adam, adamw, got "
            "\"adamm\"; did you mean \"adam\"?\n"
            "job.yaml:6:7: error: optimizer.lr: expected a number, got \"fast\"\n"
            "job.yaml:7:1: error: modle: unknown section; did you mean \"model\"?");
}

TEST(ConfigErrors, DiagnosticsSortFileOrderThenSetInInsertionOrder) {
  Diagnostics d;
  d.error(SourceLocation{"j.yaml", 5, 2, ""}, "five");
  d.error(SourceLocation{"j.yaml", 0, 0, "--set b=1"}, "set b");
  d.error(SourceLocation{"j.yaml", 2, 9, ""}, "two");
  d.error(SourceLocation{"j.yaml", 0, 0, "--set a=1"}, "set a");
  d.error(SourceLocation{"j.yaml", 2, 9, ""}, "two again");
  EXPECT_EQ(d.str(),
            "j.yaml:2:9: error: two\n"
            "j.yaml:2:9: error: two again\n"
            "j.yaml:5:2: error: five\n"
            "--set b=1: error: set b\n"
            "--set a=1: error: set a");
  EXPECT_THROW(d.throw_if_errors(), tetra::ConfigError);
  EXPECT_NO_THROW(Diagnostics().throw_if_errors());
}

// ---- YAML syntax and file problems ---------------------------------------------------------

TEST(ConfigSyntax, UnclosedBracketNamesItsLine) {
  EXPECT_EQ(errors_of("model:\n  hidden: [1, 2\ntrain:\n  epochs: 1\n"),
            "job.yaml:3:6: error: invalid YAML: end of sequence flow not found");
}

TEST(ConfigSyntax, TabIndentation) {
  EXPECT_EQ(errors_of("optimizer:\n\tlr: 0.1\n"),
            "job.yaml:2:4: error: invalid YAML: illegal map value (this line is indented with a "
            "tab; YAML needs spaces)");
}

TEST(ConfigSyntax, Garbage) {
  EXPECT_EQ(errors_of("}{"), "job.yaml:1:1: error: invalid YAML: illegal flow end");
  EXPECT_EQ(errors_of("a: *nowhere\n"),
            "job.yaml:1:4: error: invalid YAML: the referenced anchor is not defined: nowhere");
}

TEST(ConfigSyntax, DeepNestingIsAnErrorNotACrash) {
  // yaml-cpp stops at 500 levels and places the error where it noticed (the end).
  EXPECT_EQ(errors_of("model: " + std::string(100000, '[') + "\n"),
            "job.yaml:2:1: error: invalid YAML: lists or mappings nested too deeply (500 levels)");
}

TEST(ConfigSyntax, EmptyJobIsAnError) {
  EXPECT_EQ(errors_of(""), "job.yaml: error: job file is empty");
  EXPECT_EQ(errors_of("# only a comment\n"), "job.yaml: error: job file is empty");
}

TEST(ConfigSyntax, TopLevelMustBeAMapping) {
  EXPECT_EQ(errors_of("- model\n- data\n"),
            "job.yaml:1:1: error: the top level of a job file must be a mapping of sections "
            "(model:, data:, optimizer:, ...), got a list");
  EXPECT_EQ(errors_of("hello\n"),
            "job.yaml:1:1: error: the top level of a job file must be a mapping of sections "
            "(model:, data:, optimizer:, ...), got \"hello\"");
}

TEST(ConfigSyntax, OneDocumentOnly) {
  EXPECT_EQ(errors_of("train:\n  epochs: 1\n---\ntrain:\n  epochs: 2\n"),
            "job.yaml:4:1: error: a job file holds one YAML document, found 2");
}

TEST(ConfigSyntax, NeverCrashesOnOddInput) {
  const std::vector<std::string> inputs = {std::string(5000, '['),
                                           std::string(5000, '{'),
                                           "? [a, b]\n: 1\n",
                                           "\xff\xfe\x00\x01",
                                           "a: !!binary zz\n",
                                           "{a: 1, a: 2}",
                                           "model: {type: [gpt]}\n",
                                           "data: {shape: [[1]]}\n",
                                           "~: 3\n",
                                           "1: 2\n",
                                           "model:\n  hidden: [1e400]\n",
                                           "train:\n  seed: 99999999999999999999999\n",
                                           "optimizer:\n  betas: x\n",
                                           ":\n",
                                           "- - -\n",
                                           "'unterminated\n",
                                           "a: |\n  text\n"};
  for (const std::string& in : inputs) {
    try {
      parse_job_string(in, "job.yaml", {}, kNoPlugins);
    } catch (const tetra::ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("error: "), std::string::npos) << e.what();
    } catch (...) {
      ADD_FAILURE() << "not a ConfigError for input: " << in;
    }
  }
}

TEST(ConfigFile, MissingFile) {
  std::string path = (std::filesystem::path(testing::TempDir()) / "no_such_job.yaml").string();
  try {
    parse_job_file(path, {}, kNoPlugins);
    FAIL() << "a missing file parsed";
  } catch (const tetra::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              path + ": error: cannot read job file: No such file or directory");
  }
}

TEST(ConfigFile, EmptyFile) {
  std::string path = temp_file("empty.yaml", "");
  try {
    parse_job_file(path, {}, kNoPlugins);
    FAIL() << "an empty file parsed";
  } catch (const tetra::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), path + ": error: job file is empty");
  }
}

TEST(ConfigFile, ErrorsNameTheFileAndNameDefaultsToItsStem) {
  std::string path = temp_file("quickstart.yaml", "train:\n  epochs: 2\n");
  ParsedJob job = parse_job_file(path, {"train.seed=7"}, kNoPlugins);
  EXPECT_EQ(job.spec.name, "quickstart");
  EXPECT_EQ(job.spec.source, path);
  EXPECT_EQ(job.spec.train.epochs, 2);
  EXPECT_EQ(job.spec.train.seed, 7);
  EXPECT_EQ(job.spec.checkpoint.dir, "runs/quickstart/ckpt");
  EXPECT_EQ(job.spec.log.metrics, "runs/quickstart/metrics.jsonl");

  std::string bad = temp_file("bad.yaml", "train:\n  epochs: many\n");
  try {
    parse_job_file(bad, {}, kNoPlugins);
    FAIL() << "a bad file parsed";
  } catch (const tetra::ConfigError& e) {
    EXPECT_EQ(std::string(e.what()),
              bad + ":2:11: error: train.epochs: expected an integer, got \"many\"");
  }
}

// ---- cross-field rules ---------------------------------------------------------------------

TEST(ConfigRules, AccumulationStepsMustDivideTheBatch) {
  EXPECT_EQ(errors_of("data:\n  batch_size: 256\ntrain:\n  accumulation_steps: 3\n"),
            "job.yaml:4:3: error: train.accumulation_steps: data.batch_size 256 does not split into 1 "
            "data-parallel rank x 3 micro-batches (train.accumulation_steps): 256 / 3 = 85.33 samples each; "
            "make the global batch a multiple of 3");
  EXPECT_EQ(
      parse("data:\n  batch_size: 256\ntrain:\n  accumulation_steps: 4\n").train.accumulation_steps,
      4);
}

TEST(ConfigRules, NesterovNeedsMomentum) {
  EXPECT_EQ(errors_of("optimizer:\n  type: sgd\n  nesterov: true\n"),
            "job.yaml:3:3: error: optimizer.nesterov: requires optimizer.momentum > 0, got "
            "momentum 0");
  JobSpec spec = parse("optimizer:\n  type: sgd\n  momentum: 0.9\n  nesterov: true\n");
  EXPECT_TRUE(spec.optimizer.nesterov);
  EXPECT_DOUBLE_EQ(spec.optimizer.momentum, 0.9);
}

TEST(ConfigRules, GptNeedsTextData) {
  EXPECT_EQ(errors_of("model:\n  type: gpt\ndata:\n  type: fashion-mnist\n"),
            "job.yaml:2:3: error: model.type: model type gpt needs data.type text, got data.type "
            "fashion-mnist");
  EXPECT_EQ(errors_of("model:\n  type: mlp\ndata:\n  type: text\n  path: a.txt\n"),
            "job.yaml:2:3: error: model.type: model type mlp needs data.type fashion-mnist or "
            "synthetic, got data.type text (use model type gpt for text)");
}

TEST(ConfigRules, TextDataNeedsAPath) {
  EXPECT_EQ(errors_of("model:\n  type: gpt\ndata:\n  type: text\n"),
            "job.yaml:3:1: error: data.path: required for data type text (the text file to "
            "train on)");
}

TEST(ConfigRules, BetasNeedTwoNumbers) {
  EXPECT_EQ(errors_of("optimizer:\n  betas: [0.9, 0.99, 0.999]\n"),
            "job.yaml:2:3: error: optimizer.betas: expected a list of 2 numbers [beta1, beta2], "
            "got 3 numbers");
  EXPECT_EQ(errors_of("optimizer:\n  betas: [0.9, 1.5]\n"),
            "job.yaml:2:3: error: optimizer.betas: beta2 must be in [0, 1), got 1.5");
  EXPECT_EQ(errors_of("optimizer:\n  betas: [0.9, x]\n"),
            "job.yaml:2:16: error: optimizer.betas[1]: expected a number, got \"x\"");
}

TEST(ConfigRules, HeadsMustDivideDModel) {
  EXPECT_EQ(errors_of("model:\n  type: gpt\n  heads: 3\n  d_model: 128\ndata:\n  type: text\n"
                      "  path: t.txt\n"),
            "job.yaml:3:3: error: model.heads: 3 heads do not divide model.d_model 128 (d_model "
            "must be a multiple of heads)");
}

TEST(ConfigRules, CnnNeedsAnImageShape) {
  EXPECT_EQ(errors_of("model:\n  type: cnn\ndata:\n  type: synthetic\n  shape: [784]\n"),
            "job.yaml:5:3: error: data.shape: model type cnn needs an image shape [C, H, W], got "
            "[784]");
  EXPECT_EQ(
      parse("model:\n  type: cnn\ndata:\n  type: synthetic\n  shape: [3, 32, 32]\n").data.shape,
      (std::vector<int64_t>{3, 32, 32}));
  EXPECT_EQ(errors_of("model:\n  type: cnn\n  channels: [8, 8, 8, 8, 8]\n"),
            "job.yaml:3:3: error: model.channels: 5 conv blocks halve the 28x28 input below 1x1; "
            "use at most 4");
}

TEST(ConfigRules, MinLrAboveLr) {
  EXPECT_EQ(errors_of("optimizer:\n  lr: 0.001\nschedule:\n  type: cosine\n  min_lr: 0.01\n"),
            "job.yaml:5:3: error: schedule.min_lr: 0.01 is above optimizer.lr 0.001 (the decay "
            "ends at min_lr, so it must be <= lr)");
}

TEST(ConfigRules, DropoutBelowOne) {
  EXPECT_EQ(errors_of("model:\n  dropout: 1\n"),
            "job.yaml:2:3: error: model.dropout: must be in [0, 1), got 1");
}

// ---- --set overrides -------------------------------------------------------------------------

TEST(ConfigSet, OverridesValuesAndCreatesSections) {
  JobSpec spec = parse("optimizer:\n  lr: 0.1\n",
                       {"optimizer.lr=1e-3", "model.hidden=[512,256]", "train.max_steps=10"});
  EXPECT_DOUBLE_EQ(spec.optimizer.lr, 1e-3);
  EXPECT_EQ(spec.model.hidden, (std::vector<int64_t>{512, 256}));
  EXPECT_EQ(spec.train.max_steps, 10);
}

TEST(ConfigSet, LaterOverrideWinsAndEmptyValueIsEmptyString) {
  JobSpec spec =
      parse("train:\n  epochs: 1\n", {"train.epochs=2", "train.epochs=3", "log.metrics="});
  EXPECT_EQ(spec.train.epochs, 3);
  EXPECT_EQ(spec.log.metrics, "");
}

TEST(ConfigSet, BadValueNamesTheSetArgument) {
  EXPECT_EQ(errors_of("optimizer:\n  lr: 0.1\n", {"optimizer.lr=fast"}),
            "--set optimizer.lr=fast: error: optimizer.lr: expected a number, got \"fast\"");
  EXPECT_EQ(errors_of("optimizer:\n  lr: 0.1\n", {"optimizer.lrr=0.1"}),
            "--set optimizer.lrr=0.1: error: optimizer.lrr: unknown key; did you mean \"lr\"?");
  EXPECT_EQ(errors_of("train:\n  epochs: 1\n", {"model.hidden=[1, x]"}),
            "--set model.hidden=[1, x]: error: model.hidden[1]: expected an integer, got \"x\"");
}

TEST(ConfigSet, FileErrorsComeFirstThenSetErrors) {
  // --set diagnostics keep the order they were found in (the schema's reading order).
  EXPECT_EQ(errors_of("train:\n  epochs: 0\n", {"train.seed=x", "optimizer.lr=0"}),
            "job.yaml:2:11: error: train.epochs: must be >= 1, got 0\n"
            "--set optimizer.lr=0: error: optimizer.lr: must be > 0, got 0\n"
            "--set train.seed=x: error: train.seed: expected an integer, got \"x\"");
}

TEST(ConfigSet, MalformedAssignments) {
  EXPECT_EQ(errors_of("train:\n  epochs: 1\n", {"foo"}),
            "--set foo: error: expected KEY=VALUE (e.g. --set optimizer.lr=3e-4), got \"foo\"");
  EXPECT_EQ(errors_of("train:\n  epochs: 1\n", {"=3"}),
            "--set =3: error: missing key before '=' (expected KEY=VALUE, e.g. --set "
            "train.epochs=3)");
  EXPECT_EQ(errors_of("train:\n  epochs: 1\n", {"train..epochs=3"}),
            "--set train..epochs=3: error: malformed key \"train..epochs\": empty component in "
            "the dotted path");
  EXPECT_EQ(errors_of("optimizer: 3\n", {"optimizer.lr=1"}),
            "job.yaml:1:12: error: optimizer: expected a mapping (key: value lines), got 3\n"
            "--set optimizer.lr=1: error: cannot set optimizer.lr: optimizer is 3, not a mapping");
  EXPECT_EQ(errors_of("train:\n  epochs: 1\n", {"train.epochs=[1"}),
            "--set train.epochs=[1: error: train.epochs: invalid YAML value: end of sequence flow "
            "not found");
}

TEST(ConfigSet, SectionMadeBySetNamesTheSetArgument) {
  EXPECT_EQ(errors_of("model:\n  type: gpt\n", {"data.type=text"}),
            "--set data.type=text: error: data.path: required for data type text (the text "
            "file to train on)");
}

TEST(ConfigSet, OverridesAreReportedEvenWhenTheFileIsBroken) {
  EXPECT_EQ(errors_of("}{", {"foo"}),
            "job.yaml:1:1: error: invalid YAML: illegal flow end\n"
            "--set foo: error: expected KEY=VALUE (e.g. --set optimizer.lr=3e-4), got \"foo\"");
}

// ---- the resolved config ---------------------------------------------------------------------

TEST(ConfigResolved, HoldsDefaultsInTheFixedSectionOrder) {
  SectionRegistry plugins;
  plugins.add("zero", [](Section& s, const JobSpec&) -> std::shared_ptr<const PluginConfig> {
    s.integer("stage", 1, 1, 3);
    s.finish();
    return nullptr;
  });
  ParsedJob job = parse_job_string("train:\n  epochs: 2\nname: demo\nzero: {}\n", "job.yaml", {}, plugins);
  ASSERT_TRUE(job.resolved["optimizer"]["eps"].IsDefined());
  EXPECT_DOUBLE_EQ(job.resolved["optimizer"]["eps"].as<double>(), 1e-8);
  EXPECT_EQ(job.resolved["train"]["epochs"].as<int>(), 2);
  // The written paths as the job gives them (relative: inside the run folder), which
  // the spec holds resolved (Note [One run folder]).
  EXPECT_EQ(job.resolved["checkpoint"]["dir"].as<std::string>(), "ckpt");
  // log.dir left unset stays unset as written (it follows the name), and is runs/demo.
  EXPECT_TRUE(job.resolved["log"]["dir"].IsNull());
  EXPECT_EQ(job.spec.log.dir, "runs/demo");
  EXPECT_EQ(job.spec.checkpoint.dir, "runs/demo/ckpt");
  std::string text = resolved_yaml(job.resolved);
  std::vector<std::string> order = {
      "name: demo", "\nmodel:",      "\ndata:", "\noptimizer:", "\nschedule:",
      "\ntrain:",   "\ncheckpoint:", "\nlog:",  "\nzero:"};
  size_t last = 0;
  for (const std::string& key : order) {
    size_t at = text.find(key);
    ASSERT_NE(at, std::string::npos) << key << " missing from:\n" << text;
    EXPECT_GE(at, last) << key << " out of order in:\n" << text;
    last = at;
  }
  EXPECT_EQ(text.rfind("name: demo", 0), 0u) << text;
  EXPECT_NE(text.find("lr: 0.001"), std::string::npos) << text;
  EXPECT_NE(text.find("hidden: [1024, 1024]"), std::string::npos) << text;
  // What --print-config prints reads back as the same job.
  JobSpec again = parse_job_string(text, "job.yaml", {}, plugins).spec;
  EXPECT_EQ(again.train.epochs, 2);
  EXPECT_EQ(again.name, "demo");
  EXPECT_EQ(again.checkpoint.dir, "runs/demo/ckpt");
  EXPECT_EQ(again.log.metrics, "runs/demo/metrics.jsonl");
}

// Issue 33: a strategy's section the job leaves out is not written out with its defaults,
// or job.yaml read back turned the strategy on (a one-stage pipeline of 4 micro-batches).
TEST(ConfigResolved, LeavesOutTheSectionsOfStrategiesTheJobDoesNotHave) {
  SectionRegistry plugins;
  plugins.add("pipeline", [](Section& s, const JobSpec&) -> std::shared_ptr<const PluginConfig> {
    const bool present = s.has("micro_batches");
    s.integer("micro_batches", 4, 1, 64);
    s.finish();
    return present ? std::make_shared<PluginConfig>() : nullptr;
  });
  const std::string text = resolved_yaml(parse_job_string("name: demo\n", "job.yaml", {}, plugins).resolved);
  EXPECT_EQ(text.find("\npipeline:"), std::string::npos) << text;
  EXPECT_TRUE(parse_job_string(text, "job.yaml", {}, plugins).spec.plugins.empty());
  const std::string with = resolved_yaml(
      parse_job_string("name: demo\npipeline: {micro_batches: 2}\n", "job.yaml", {}, plugins).resolved);
  EXPECT_NE(with.find("micro_batches: 2"), std::string::npos) << with;
}

// Issue 33, item 2: every path a run writes is inside log.dir, runs/<name> by default,
// so a new name or a new log.dir moves the whole run; absolute paths stay.
TEST(ConfigRunFolder, EveryWrittenPathFollowsTheNameAndTheRunFolder) {
  auto spec = [](std::vector<std::string> sets) {
    return parse_job_string("name: a\nlog: {trace: trace.json, tensorboard: tb}\ncheckpoint: {safetensors: model.safetensors}\n",
                            "job.yaml", sets, kNoPlugins)
        .spec;
  };
  for (const auto& [sets, dir] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{}, "runs/a"}, {{"name=b"}, "runs/b"}, {{"log.dir=/tmp/elsewhere/r"}, "/tmp/elsewhere/r"}}) {
    const JobSpec s = spec(sets);
    EXPECT_EQ(s.log.dir, dir);
    EXPECT_EQ(s.checkpoint.dir, dir + "/ckpt");
    EXPECT_EQ(s.log.metrics, dir + "/metrics.jsonl");
    EXPECT_EQ(s.log.trace, dir + "/trace.json");
    EXPECT_EQ(s.log.tensorboard, dir + "/tb");
    EXPECT_EQ(s.checkpoint.safetensors, dir + "/model.safetensors");
  }
  const JobSpec abs = spec({"checkpoint.dir=/data/ckpt", "log.metrics="});
  EXPECT_EQ(abs.checkpoint.dir, "/data/ckpt");
  EXPECT_EQ(abs.log.metrics, "");  // off
  const JobSpec no_folder = spec({"log.dir="});
  EXPECT_EQ(no_folder.checkpoint.dir, "ckpt");  // from the current directory
}

TEST(ConfigResolved, GptDffIsResolved) {
  ParsedJob job =
      parse_job_string("model:\n  type: gpt\n  d_model: 64\ndata:\n  type: text\n  path: t.txt\n",
                       "job.yaml", {}, kNoPlugins);
  EXPECT_EQ(job.spec.model.d_ff, 256);
  EXPECT_EQ(job.resolved["model"]["d_ff"].as<int>(), 256);
}

// ---- plugin sections ---------------------------------------------------------------------------

struct ZeroConfig : PluginConfig {
  int64_t stage = 1;
  bool offload = false;
};

SectionRegistry zero_registry() {
  SectionRegistry r;
  r.add("zero", [](Section& s, const JobSpec& job) -> std::shared_ptr<const PluginConfig> {
    bool present = !s.keys().empty();
    auto cfg = std::make_shared<ZeroConfig>();
    cfg->stage = s.integer("stage", 1, 1, 3);
    cfg->offload = s.boolean("offload", false);
    if (cfg->offload && job.train.precision == Precision::kBf16)
      s.error("offload", "cannot be used with train.precision bf16");
    s.finish();
    return present ? cfg : nullptr;
  });
  return r;
}

TEST(ConfigPlugins, RegisteredSectionParses) {
  SectionRegistry r = zero_registry();
  JobSpec spec = parse("zero:\n  stage: 2\n  offload: true\n", {}, r);
  auto zero = spec.plugin<ZeroConfig>("zero");
  ASSERT_NE(zero, nullptr);
  EXPECT_EQ(zero->stage, 2);
  EXPECT_TRUE(zero->offload);
}

TEST(ConfigPlugins, PluginSectionErrorsAreReported) {
  SectionRegistry r = zero_registry();
  EXPECT_EQ(errors_of("zero:\n  stag: 2\n  stage: 5\n", {}, r),
            "job.yaml:2:3: error: zero.stag: unknown key; did you mean \"stage\"?\n"
            "job.yaml:3:10: error: zero.stage: must be in [1, 3], got 5");
  EXPECT_EQ(errors_of("train:\n  precision: bf16\nzero:\n  offload: true\n", {}, r),
            "job.yaml:4:3: error: zero.offload: cannot be used with train.precision bf16");
  EXPECT_EQ(errors_of("zeroo:\n  stage: 2\n", {}, r),
            "job.yaml:1:1: error: zeroo: unknown section; did you mean \"zero\"?");
}

TEST(ConfigPlugins, AbsentSectionLeavesPluginsEmpty) {
  SectionRegistry r = zero_registry();
  JobSpec spec = parse("train:\n  epochs: 1\n", {}, r);
  EXPECT_TRUE(spec.plugins.empty());
  EXPECT_EQ(spec.plugin<ZeroConfig>("zero"), nullptr);
}

TEST(ConfigPlugins, ParserThatThrowsBecomesADiagnostic) {
  SectionRegistry r;
  r.add("boom", [](Section&, const JobSpec&) -> std::shared_ptr<const PluginConfig> {
    throw std::runtime_error("exploded");
  });
  EXPECT_EQ(errors_of("boom:\n  x: 1\n", {}, r), "job.yaml:1:1: error: boom: exploded");
}

TEST(ConfigPlugins, RegistryRejectsDuplicatesAndListsKnownNames) {
  SectionRegistry r = zero_registry();
  EXPECT_TRUE(r.contains("zero"));
  EXPECT_FALSE(r.contains("pipeline"));
  EXPECT_THROW(r.add("zero", [](Section&, const JobSpec&) { return nullptr; }), tetra::Error);
  EXPECT_THROW(r.add("model", [](Section&, const JobSpec&) { return nullptr; }), tetra::Error);
  r.add("pipeline", [](Section&, const JobSpec&) { return nullptr; });
  EXPECT_EQ(r.names(), (std::vector<std::string>{"pipeline", "zero"}));
  try {
    r.at("tensor");
    FAIL() << "at() of a missing name returned";
  } catch (const tetra::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "no plugin section \"tensor\" is registered (known: pipeline, zero)");
  }
}

// ---- a valid job -------------------------------------------------------------------------------

TEST(ConfigValid, FullJobParsesIntoTheStructs) {
  const std::string yaml = R"(name: full
model:
  type: cnn
  channels: [16, 32]
  hidden: [64]
  activation: gelu
  dropout: 0.1
data:
  type: synthetic
  shape: [1, 28, 28]
  classes: 5
  train_samples: 512
  test_samples: 128
  batch_size: 64
  eval_batch_size: 100
  eval_samples: 50
  shuffle: false
optimizer:
  type: sgd
  lr: 0.05
  momentum: 0.9
  nesterov: true
  weight_decay: 1e-4
  clip_grad_norm: 1.0
schedule:
  type: cosine
  warmup_steps: 10
  min_lr: 0.001
  decay_steps: 100
train:
  epochs: 3
  max_steps: 200
  eval_every: 20
  seed: -5
  threads: 2
  precision: bf16
  accumulation_steps: 2
checkpoint:
  dir: out/ckpt
  every_steps: 50
  keep: 2
  resume: never
  safetensors: out/model.safetensors
log:
  metrics: out/m.jsonl
  every: 10
  trace: out/trace.json
  progress: plain
)";
  JobSpec s = parse(yaml);
  EXPECT_EQ(s.name, "full");
  EXPECT_EQ(s.model.type, "cnn");
  EXPECT_EQ(s.model.channels, (std::vector<int64_t>{16, 32}));
  EXPECT_EQ(s.model.hidden, (std::vector<int64_t>{64}));
  EXPECT_EQ(s.model.activation, "gelu");
  EXPECT_DOUBLE_EQ(s.model.dropout, 0.1);
  EXPECT_EQ(s.data.type, "synthetic");
  EXPECT_EQ(s.data.shape, (std::vector<int64_t>{1, 28, 28}));
  EXPECT_EQ(s.data.classes, 5);
  EXPECT_EQ(s.data.train_samples, 512);
  EXPECT_EQ(s.data.test_samples, 128);
  EXPECT_EQ(s.data.batch_size, 64);
  EXPECT_EQ(s.data.eval_batch_size, 100);
  EXPECT_EQ(s.data.eval_samples, 50);
  EXPECT_FALSE(s.data.shuffle);
  EXPECT_EQ(s.optimizer.type, "sgd");
  EXPECT_DOUBLE_EQ(s.optimizer.lr, 0.05);
  EXPECT_DOUBLE_EQ(s.optimizer.momentum, 0.9);
  EXPECT_TRUE(s.optimizer.nesterov);
  EXPECT_DOUBLE_EQ(s.optimizer.weight_decay, 1e-4);
  EXPECT_DOUBLE_EQ(s.optimizer.clip_grad_norm, 1.0);
  EXPECT_EQ(s.schedule.type, "cosine");
  EXPECT_EQ(s.schedule.warmup_steps, 10);
  EXPECT_DOUBLE_EQ(s.schedule.min_lr, 0.001);
  EXPECT_EQ(s.schedule.decay_steps, 100);
  EXPECT_EQ(s.train.epochs, 3);
  EXPECT_EQ(s.train.max_steps, 200);
  EXPECT_EQ(s.train.eval_every, 20);
  EXPECT_EQ(s.train.seed, -5);
  EXPECT_EQ(s.train.threads, 2);
  EXPECT_EQ(s.train.precision, Precision::kBf16);
  EXPECT_EQ(s.train.accumulation_steps, 2);
  EXPECT_EQ(s.checkpoint.dir, "runs/full/out/ckpt");  // in the run folder (Note [One run folder])
  EXPECT_EQ(s.checkpoint.every_steps, 50);
  EXPECT_EQ(s.checkpoint.keep, 2);
  EXPECT_EQ(s.checkpoint.resume, "never");
  EXPECT_EQ(s.checkpoint.safetensors, "runs/full/out/model.safetensors");
  EXPECT_EQ(s.log.metrics, "runs/full/out/m.jsonl");
  EXPECT_EQ(s.log.every, 10);
  EXPECT_EQ(s.log.trace, "runs/full/out/trace.json");
  EXPECT_EQ(s.log.progress, "plain");
  EXPECT_TRUE(s.plugins.empty());
}

TEST(ConfigValid, GptOnTextAndDefaults) {
  JobSpec s = parse(
      "model:\n  type: gpt\n  layers: 2\ndata:\n  type: text\n  path: corpus.txt\n"
      "  seq_len: 64\n");
  EXPECT_EQ(s.name, "job");
  EXPECT_EQ(s.model.layers, 2);
  EXPECT_EQ(s.model.heads, 4);
  EXPECT_EQ(s.model.d_model, 128);
  EXPECT_EQ(s.model.d_ff, 512);
  EXPECT_EQ(s.data.path, "corpus.txt");
  EXPECT_EQ(s.data.seq_len, 64);
  EXPECT_DOUBLE_EQ(s.data.test_fraction, 0.1);
  EXPECT_EQ(s.optimizer.type, "adamw");
  EXPECT_DOUBLE_EQ(s.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(s.optimizer.beta2, 0.999);
  EXPECT_EQ(s.checkpoint.resume, "auto");
  EXPECT_EQ(s.log.progress, "auto");
}

TEST(ConfigValid, MlpMayHaveNoHiddenLayers) {
  EXPECT_TRUE(parse("model:\n  hidden: []\n").model.hidden.empty());
}

// ---- regressions: inputs that once crashed the parser (tools/fuzz.sh) ---------------------

// A plugin that owns the data axis and is off: enough for mesh.data > 1 to reach the plan's
// rules without linking a strategy.
SectionRegistry data_axis_plugin() {
  SectionRegistry plugins;
  plugins.add("data_parallel", [](Section& s, const JobSpec&) -> std::shared_ptr<const PluginConfig> {
    s.finish();
    return nullptr;
  }, "data");
  return plugins;
}

TEST(ConfigRegressions, HugeAccumulationStepsIsAnErrorNotADivisionByZero) {
  // 4 data ranks x 2^62 micro-batches overflowed int64 to 0 in Plan::issues, which then
  // took batch_size % 0: `train --check` died of SIGFPE. The key is bounded like
  // pipeline.micro_batches now.
  EXPECT_EQ(errors_of("mesh: {data: 4}\ntrain: {accumulation_steps: 4611686018427387904}\n", {},
                      data_axis_plugin()),
            "job.yaml:2:29: error: train.accumulation_steps: must be in [1, 1048576], got "
            "4611686018427387904");
  EXPECT_EQ(errors_of("mesh: {data: 4}\n", {"train.accumulation_steps=4611686018427387904"},
                      data_axis_plugin()),
            "--set train.accumulation_steps=4611686018427387904: error: train.accumulation_steps: "
            "must be in [1, 1048576], got 4611686018427387904");
  // The largest allowed still reaches the plan's rule, with its numbers.
  EXPECT_NE(errors_of("mesh: {data: 4}\ndata: {batch_size: 8}\ntrain: {accumulation_steps: 1048576}\n",
                      {}, data_axis_plugin())
                .find("does not split into 4 data-parallel ranks x 1048576 micro-batches"),
            std::string::npos);
}

TEST(ConfigRegressions, BytesThatAreNotUtf8AreAnErrorNotAHangInsideYamlCpp) {
  // tools/fuzz found it: 0xFF bytes in a comment made yaml-cpp 0.7's LoadAll spin for
  // minutes (train --check never answered). The text is refused before yaml-cpp reads it.
  std::ifstream in(std::string(TETRA_SOURCE_DIR) + "/tools/fuzz/findings/timeout-yaml-loadall.yaml", std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  ASSERT_FALSE(text.empty());
  const std::string e = errors_of(text, {}, data_axis_plugin());
  EXPECT_NE(e.find("the job file is not UTF-8 text (byte 0xff at line 3, column 76)"), std::string::npos) << e;
  EXPECT_NE(errors_of("mesh: {data: 4}\n", {"name=ab\xff"}, data_axis_plugin()).find("name: the value is not UTF-8 text"),
            std::string::npos);
  // UTF-8 itself is fine.
  EXPECT_NO_THROW(parse_job_string("name: \"caf\xc3\xa9 \xe2\x9c\x93\"\nmesh: {data: 4}\n", "job.yaml", {}, data_axis_plugin()));
}

TEST(ConfigRegressions, ACommaOutsideAFlowCollectionIsAnErrorNotAHangInsideYamlCpp) {
  // tools/fuzz found it: a line starting with ',' (a stray comma in a comment's place) made
  // yaml-cpp 0.7's LoadAll loop for ever, eating memory (jbeder/yaml-cpp#1040). The
  // documents are walked first and the one that does not advance is an error at its place.
  std::ifstream in(std::string(TETRA_SOURCE_DIR) + "/tools/fuzz/findings/timeout-yaml-loadall-comma.yaml",
                   std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  ASSERT_FALSE(text.empty());
  const std::string e = errors_of(text, {}, data_axis_plugin());
  EXPECT_NE(e.find("job.yaml:2:1: error: invalid YAML: a ',' outside [ ] or { }"), std::string::npos) << e;
  for (const char* t : {",\n", ", {a: 1}\n", "---\n,\n", "name: x\n...\n,\n", "- a\n,\n", "  ,\n"})
    EXPECT_NE(errors_of(t, {}, data_axis_plugin()).find("invalid YAML: a ',' outside"), std::string::npos) << t;
  // A comma inside a flow collection, or in a value, is still fine.
  EXPECT_NO_THROW(parse_job_string("name: \"a, b\"\nmesh: {data: 4}\nmodel: {type: mlp, hidden: [8, 8]}\n", "job.yaml", {},
                                   data_axis_plugin()));
}

// Issue 28, item 7: NCCL for the axes whose tensors are on GPUs. collectives.backend
// defaults to auto, which is nccl for a job on cuda and mpi otherwise; a backend the job
// names is kept (device_problem then says when it cannot carry CUDA tensors).
TEST(ConfigBackend, AutoIsNcclOnCudaAndMpiOnCpu) {
  EXPECT_EQ(parse("train: {max_steps: 1}\n").collectives.backend, "auto");
  EXPECT_EQ(backend_of(parse("train: {max_steps: 1}\n")), "mpi");
  EXPECT_EQ(backend_of(parse("train: {max_steps: 1, device: cuda}\n")), "nccl");
  EXPECT_EQ(backend_of(parse("train: {device: cuda}\ncollectives: {backend: gloo}\n")), "gloo");
  EXPECT_EQ(backend_of(parse("collectives: {backend: mpi}\n", {"train.device=cuda"})), "mpi");
  EXPECT_NE(errors_of("collectives: {backend: ncl}\n").find("did you mean \"nccl\"?"), std::string::npos);
}

}  // namespace
}  // namespace tetra::core

#include "core/models.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "collectives/error.h"
#include "core/random.h"
#include "tests/common/data_infos.h"

using tetra::core::build_model;
using tetra::core::count_correct;
using tetra::core::DataInfo;
using tetra::core::describe;
using tetra::core::model_loss;
using tetra::core::ModelSpec;
using tetra::core::parameter_count;
using tetra::core::RandomContext;

namespace {

using tetra::testing_data::image_info;
using tetra::testing_data::text_info;

ModelSpec spec_of(const std::string& type) {
  ModelSpec s;
  s.type = type;
  return s;
}

ModelSpec small_gpt() {
  ModelSpec s = spec_of("gpt");
  s.layers = 2;
  s.heads = 4;
  s.d_model = 32;
  return s;
}

std::string config_error_of(const ModelSpec& spec, const DataInfo& data) {
  try {
    build_model(spec, data, 1);
  } catch (const tetra::ConfigError& e) {
    return e.what();
  }
  return "no ConfigError";
}

// One plain SGD step on a fixed batch; returns the losses before and after.
std::pair<double, double> sgd_step(torch::nn::Sequential& model, const torch::Tensor& x,
                                   const torch::Tensor& y, double lr) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(lr));
  model->train();
  opt.zero_grad();
  torch::Tensor loss = model_loss(model->forward(x), y);
  loss.backward();
  opt.step();
  torch::NoGradGuard ng;
  const double after = model_loss(model->forward(x), y).item<double>();
  return {loss.item<double>(), after};
}

}  // namespace

TEST(Models, MlpShapesAndParameterCount) {
  torch::manual_seed(0);
  ModelSpec spec = spec_of("mlp");  // default hidden: 1024, 1024
  auto mlp = build_model(spec, image_info(), 1);
  EXPECT_EQ(parameter_count(*mlp), 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10);
  EXPECT_EQ(mlp->forward(torch::randn({5, 1, 28, 28})).sizes(), (std::vector<int64_t>{5, 10}));

  spec.hidden = {};
  auto linear = build_model(spec, image_info(), 1);
  EXPECT_EQ(linear->size(), 2u);  // Flatten, Linear
  EXPECT_EQ(parameter_count(*linear), 784 * 10 + 10);
  EXPECT_EQ(linear->forward(torch::randn({3, 1, 28, 28})).sizes(), (std::vector<int64_t>{3, 10}));

  spec.hidden = {64, 32};
  spec.activation = "gelu";
  spec.dropout = 0.1;
  auto small = build_model(spec, image_info(), 1);
  // Flatten, (Linear, GELU, Dropout) x 2, Linear
  EXPECT_EQ(small->size(), 8u);
  {
    RandomContext::Scope random(0, 0, 0);  // training-mode dropout draws from a key
    EXPECT_EQ(small->forward(torch::randn({4, 1, 28, 28})).sizes(), (std::vector<int64_t>{4, 10}));
  }
  const std::string text = describe(small);
  EXPECT_NE(text.find("Linear(in_features=784, out_features=64, bias=true)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("GELU"), std::string::npos) << text;
  EXPECT_NE(text.find("Dropout"), std::string::npos) << text;
  EXPECT_NE(text.find(std::to_string(784 * 64 + 64)), std::string::npos) << text;

  // Synthetic data of a flat shape.
  DataInfo flat;
  flat.input_shape = {20};
  flat.num_classes = 3;
  spec.activation = "tanh";
  RandomContext::Scope random(0, 0, 0);
  EXPECT_EQ(build_model(spec, flat, 1)->forward(torch::randn({2, 20})).sizes(),
            (std::vector<int64_t>{2, 3}));
}

TEST(Models, CnnShapes) {
  torch::manual_seed(0);
  ModelSpec spec = spec_of("cnn");
  spec.channels = {8, 16};
  spec.hidden = {32};
  auto cnn = build_model(spec, image_info(), 1);
  EXPECT_EQ(cnn->forward(torch::randn({3, 1, 28, 28})).sizes(), (std::vector<int64_t>{3, 10}));
  // conv 1->8, conv 8->16, 16*7*7 -> 32 -> 10
  EXPECT_EQ(parameter_count(*cnn),
            (9 * 8 + 8) + (8 * 9 * 16 + 16) + (16 * 7 * 7 * 32 + 32) + (32 * 10 + 10));

  spec.channels = {4, 4, 4, 4, 4};  // 28 -> 14 -> 7 -> 3 -> 1 -> 0
  const std::string err = config_error_of(spec, image_info());
  EXPECT_NE(err.find("model.channels"), std::string::npos) << err;

  DataInfo flat;
  flat.input_shape = {784};
  flat.num_classes = 10;
  EXPECT_NE(config_error_of(spec_of("cnn"), flat).find("[C, H, W]"), std::string::npos);
}

TEST(Models, GptShapesAndCausality) {
  torch::manual_seed(0);
  auto gpt = build_model(small_gpt(), text_info(16), 1);
  EXPECT_EQ(gpt->size(), 4u);  // embedding, 2 blocks, head
  gpt->eval();
  torch::NoGradGuard ng;
  torch::Tensor tokens = torch::randint(0, 256, {2, 16}, torch::kLong);
  torch::Tensor out = gpt->forward(tokens);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 16, 256}));
  EXPECT_EQ(out.scalar_type(), torch::kFloat);

  for (int64_t t : {0, 5, 15}) {
    torch::Tensor changed = tokens.clone();
    changed.index_put_({torch::indexing::Slice(), t}, (tokens.index({torch::indexing::Slice(), t}) + 1) % 256);
    torch::Tensor out2 = gpt->forward(changed);
    if (t > 0) {
      EXPECT_TRUE(torch::allclose(out.slice(1, 0, t), out2.slice(1, 0, t), 1e-5, 1e-6))
          << "position < " << t << " changed";
    }
    EXPECT_FALSE(torch::allclose(out.slice(1, t, 16), out2.slice(1, t, 16)))
        << "position " << t << " did not see its own token";
  }
  // Shorter sequences than the context work.
  EXPECT_EQ(gpt->forward(tokens.slice(1, 0, 5)).sizes(), (std::vector<int64_t>{2, 5, 256}));

  // Initialisation: small normal weights, zero biases.
  for (const auto& p : gpt->named_parameters()) {
    if (p.key().find("bias") != std::string::npos &&
        p.key().find("ln") == std::string::npos) {
      EXPECT_EQ(p.value().abs().max().item<double>(), 0.0) << p.key();
    }
  }
  const std::string text = describe(gpt);
  EXPECT_NE(text.find("GptBlock"), std::string::npos) << text;
  EXPECT_NE(text.find("GptHead"), std::string::npos) << text;
}

TEST(Models, GptCloneKeepsWeights) {
  torch::manual_seed(0);
  auto gpt = build_model(small_gpt(), text_info(8), 1);
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(gpt->clone());
  ASSERT_TRUE(copy);
  gpt->eval();
  copy->eval();
  torch::NoGradGuard ng;
  torch::Tensor tokens = torch::randint(0, 256, {2, 8}, torch::kLong);
  EXPECT_TRUE(torch::equal(gpt->forward(tokens), copy->forward(tokens)));
  EXPECT_EQ(parameter_count(*copy), parameter_count(*gpt));
}

TEST(Models, GptParameterCount) {
  ModelSpec s = small_gpt();
  s.layers = 1;
  s.d_ff = 48;
  auto gpt = build_model(s, text_info(16), 1);
  const int64_t d = 32, V = 256, T = 16, ff = 48;
  const int64_t block = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d);
  EXPECT_EQ(parameter_count(*gpt), V * d + T * d + block + 2 * d + (d * V + V));
  // No buffers (a causal mask is built on the fly, never saved in checkpoints).
  EXPECT_TRUE(gpt->buffers().empty());
}

TEST(Models, ModelDataMismatchIsConfigError) {
  std::string err = config_error_of(small_gpt(), image_info());
  EXPECT_NE(err.find("gpt"), std::string::npos) << err;
  EXPECT_NE(err.find("Fashion-MNIST"), std::string::npos) << err;
  err = config_error_of(spec_of("mlp"), text_info(16));
  EXPECT_NE(err.find("mlp"), std::string::npos) << err;
  EXPECT_NE(err.find("text"), std::string::npos) << err;
  err = config_error_of(spec_of("cnn"), text_info(16));
  EXPECT_NE(err.find("cnn"), std::string::npos) << err;
  err = config_error_of(spec_of("resnet"), image_info());
  EXPECT_NE(err.find("resnet"), std::string::npos) << err;
  ModelSpec bad = small_gpt();
  bad.heads = 3;
  EXPECT_NE(config_error_of(bad, text_info(16)).find("divisible"), std::string::npos);
  bad = spec_of("mlp");
  bad.activation = "swish";
  EXPECT_NE(config_error_of(bad, image_info()).find("swish"), std::string::npos);
}

TEST(Models, LossAndCorrectCounts) {
  // Uniform logits: the loss is log(classes).
  EXPECT_NEAR(model_loss(torch::zeros({4, 10}), torch::tensor({0, 3, 9, 2}, torch::kLong)).item<double>(),
              std::log(10.0), 1e-6);
  EXPECT_NEAR(model_loss(torch::zeros({2, 5, 256}), torch::randint(0, 256, {2, 5}, torch::kLong))
                  .item<double>(),
              std::log(256.0), 1e-5);
  // Token loss is the mean over every token of the batch.
  torch::Tensor logits = torch::randn({2, 3, 7});
  torch::Tensor targets = torch::randint(0, 7, {2, 3}, torch::kLong);
  torch::Tensor manual = -torch::log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).mean();
  EXPECT_NEAR(model_loss(logits, targets).item<double>(), manual.item<double>(), 1e-5);

  torch::Tensor out = torch::tensor({{0.1, 0.9, 0.0}, {0.8, 0.1, 0.1}, {0.2, 0.3, 0.5}, {0.0, 0.0, 1.0}});
  EXPECT_EQ(count_correct(out, torch::tensor({1, 0, 0, 2}, torch::kLong)), 3);
  EXPECT_EQ(count_correct(out, torch::tensor({0, 1, 1, 0}, torch::kLong)), 0);
  torch::Tensor seq = torch::zeros({1, 3, 4});
  seq[0][0][2] = 1;
  seq[0][1][0] = 1;
  seq[0][2][3] = 1;
  EXPECT_EQ(count_correct(seq, torch::tensor({{2, 0, 1}}, torch::kLong)), 2);
}

TEST(Models, OneSgdStepReducesTheLoss) {
  torch::manual_seed(1);
  const torch::Tensor images = torch::randn({16, 1, 28, 28});
  const torch::Tensor labels = torch::randint(0, 10, {16}, torch::kLong);
  {
    ModelSpec s = spec_of("mlp");
    s.hidden = {64};
    auto m = build_model(s, image_info(), 1);
    auto [before, after] = sgd_step(m, images, labels, 0.05);
    EXPECT_LT(after, before) << "mlp";
  }
  {
    ModelSpec s = spec_of("cnn");
    s.channels = {4, 8};
    s.hidden = {32};
    auto m = build_model(s, image_info(), 1);
    auto [before, after] = sgd_step(m, images, labels, 0.05);
    EXPECT_LT(after, before) << "cnn";
  }
  {
    auto m = build_model(small_gpt(), text_info(16), 1);
    const torch::Tensor tokens = torch::randint(0, 256, {4, 17}, torch::kLong);
    auto [before, after] = sgd_step(m, tokens.slice(1, 0, 16), tokens.slice(1, 1, 17), 0.5);
    EXPECT_NEAR(before, std::log(256.0), 0.1);  // GPT-2 init: near-uniform predictions
    EXPECT_LT(after, before) << "gpt";
  }
}

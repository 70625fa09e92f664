// Models as shapes and layout-invariant initial weights (Note [Layout-invariant
// initialisation], core/init.h): any slice of a tensor draws the bytes the whole tensor
// holds there; the draws have the distributions they name; a model built as shapes holds
// no storage until the Materializer creates it, and a layer run as a probe goes back to
// being a shape.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "collectives/error.h"
#include "core/init.h"
#include "core/layers.h"
#include "core/models.h"
#include "tests/common/data_infos.h"

using namespace tetra;
using namespace tetra::core;

namespace {

using tetra::testing_data::image_info;
using tetra::testing_data::text_info;

at::Tensor drawn(const Init& init, const std::string& name, int64_t n, int64_t first = 0,
                 uint64_t seed = 7, at::ScalarType dtype = at::kFloat) {
  at::Tensor t = at::empty({n}, at::TensorOptions().dtype(dtype));
  draw(init, seed, name, first, t);
  return t;
}

ModelSpec gpt() {
  ModelSpec s;
  s.type = "gpt";
  s.layers = 2;
  s.d_model = 32;
  s.heads = 2;
  return s;
}

}  // namespace

// Every cut of the element range — odd starts, a lone second element of a normal pair,
// one element, slices handed to several threads — holds the whole tensor's bytes there.
TEST(Init, AnySliceDrawsTheWholeTensorsBytes) {
  for (const Init& init : {Init::uniform(-0.5, 0.25), Init::normal(0.1, 0.02)}) {
    for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
      const int64_t n = 100003;  // several threads' grains, and odd
      const at::Tensor whole = drawn(init, "3.weight", n, 0, 7, dtype);
      for (auto [first, count] : std::vector<std::pair<int64_t, int64_t>>{
               {0, 1}, {1, 1}, {1, 2}, {17, 4000}, {50000, 50003}, {99999, 4}, {33333, 33334}}) {
        const at::Tensor part = drawn(init, "3.weight", count, first, 7, dtype);
        EXPECT_TRUE(at::equal(part, whole.narrow(0, first, count)))
            << init.str() << " " << c10::toString(dtype) << " [" << first << ", " << first + count
            << ")";
      }
    }
  }
}

TEST(Init, DrawsHaveTheirDistributions) {
  const int64_t n = 400000;
  const at::Tensor u = drawn(Init::uniform(-0.25, 0.75), "u", n).to(at::kDouble);
  EXPECT_GE(u.min().item<double>(), -0.25);
  EXPECT_LE(u.max().item<double>(), 0.75);
  EXPECT_NEAR(u.mean().item<double>(), 0.25, 0.002);
  EXPECT_NEAR(u.std().item<double>(), 1.0 / std::sqrt(12.0), 0.002);
  const at::Tensor z = drawn(Init::normal(1.5, 0.02), "z", n).to(at::kDouble);
  EXPECT_NEAR(z.mean().item<double>(), 1.5, 1e-4);
  EXPECT_NEAR(z.std().item<double>(), 0.02, 2e-4);
  // Within 1 and 2 standard deviations: 68.3% and 95.4%.
  const at::Tensor dev = (z - 1.5).abs() / 0.02;
  EXPECT_NEAR(dev.lt(1).to(at::kDouble).mean().item<double>(), 0.6827, 0.003);
  EXPECT_NEAR(dev.lt(2).to(at::kDouble).mean().item<double>(), 0.9545, 0.002);
  // Neighbours are independent (a pair shares Box-Muller's radius, not its sign or angle).
  const at::Tensor even = z.slice(0, 0, n, 2) - 1.5, odd = z.slice(0, 1, n, 2) - 1.5;
  EXPECT_NEAR((even * odd).mean().item<double>() / (0.02 * 0.02), 0.0, 0.01);
  EXPECT_TRUE(at::equal(drawn(Init::constant(0.5), "c", 5), at::full({5}, 0.5)));
}

TEST(Init, TheKeyIsTheSeedAndTheName) {
  const at::Tensor a = drawn(Init::normal(0, 1), "1.weight", 64, 0, 1);
  EXPECT_TRUE(at::equal(a, drawn(Init::normal(0, 1), "1.weight", 64, 0, 1)));
  EXPECT_FALSE(at::equal(a, drawn(Init::normal(0, 1), "1.weight", 64, 0, 2)));
  EXPECT_FALSE(at::equal(a, drawn(Init::normal(0, 1), "1.bias", 64, 0, 1)));
}

// A zoo model built as shapes holds no bytes; created, it holds exactly its parameters;
// built twice at one seed it is the same bytes, at another seed other bytes.
TEST(Init, ShapesHoldNothingAndCreatingThemIsDeterministic) {
  ModelSpec mlp;
  mlp.type = "mlp";
  mlp.hidden = {64, 32};
  torch::nn::Sequential shapes = model_shapes(mlp, image_info());
  for (const auto& p : shapes->parameters()) EXPECT_TRUE(p.is_meta());
  EXPECT_EQ(created_bytes(*shapes), 0);
  Materializer weights(*shapes, 3);
  EXPECT_FALSE(weights.given());
  EXPECT_EQ(weights.rule("1.weight").str(), Init::fan_in_uniform(784).str());
  weights.create_all(*shapes);
  EXPECT_EQ(created_bytes(*shapes), parameter_count(*shapes) * 4);
  for (const auto& p : shapes->parameters()) EXPECT_TRUE(p.device().is_cpu() && p.requires_grad());

  for (const ModelSpec& spec : {mlp, gpt()}) {
    const DataInfo info = spec.type == "gpt" ? text_info(16) : image_info();
    auto a = build_model(spec, info, 3), b = build_model(spec, info, 3),
         c = build_model(spec, info, 4);
    auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
    for (const auto& p : pa) {
      EXPECT_TRUE(at::equal(p.value(), pb[p.key()])) << p.key();
      if (p.value().numel() > 1 && p.value().std().item<double>() > 0) {
        EXPECT_FALSE(at::equal(p.value(), pc[p.key()])) << p.key();
      }
    }
  }
}

// The distributions the zoo's layers draw, by layer type.
TEST(Init, TheZoosLayersDrawTheirUsualDistributions) {
  torch::nn::Sequential g = build_model(gpt(), text_info(16), 1);
  auto params = g->named_parameters();
  EXPECT_NEAR(params["0.tok.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["0.pos"].std().item<double>(), 0.02, 0.002);
  EXPECT_NEAR(params["1.qkv.weight"].std().item<double>(), 0.02, 0.002);
  EXPECT_TRUE(at::equal(params["1.qkv.bias"], at::zeros_like(params["1.qkv.bias"])));
  EXPECT_TRUE(at::equal(params["1.ln1.weight"], at::ones_like(params["1.ln1.weight"])));
  EXPECT_TRUE(at::equal(params["1.ln1.bias"], at::zeros_like(params["1.ln1.bias"])));

  ModelSpec cnn;
  cnn.type = "cnn";
  cnn.channels = {4};
  cnn.hidden = {16};
  torch::nn::Sequential c = build_model(cnn, image_info(), 1);
  auto cp = c->named_parameters();
  const double conv_bound = 1 / std::sqrt(9.0);  // fan in 1 x 3 x 3
  EXPECT_LE(cp["0.weight"].abs().max().item<double>(), conv_bound);
  EXPECT_GT(cp["0.weight"].abs().max().item<double>(), 0.8 * conv_bound);
  const double fc_bound = 1 / std::sqrt(4.0 * 14 * 14);
  EXPECT_LE(cp["4.weight"].abs().max().item<double>(), fc_bound);
  EXPECT_LE(cp["4.bias"].abs().max().item<double>(), fc_bound);
}

// tetra's layers compute what torch::nn's compute from the same weights.
TEST(Init, LayersComputeWhatTorchsLayersCompute) {
  torch::NoGradGuard no_grad;
  Linear lin(12, 5);
  Materializer(*lin, 1).create_all(*lin);
  torch::nn::Linear ref(12, 5);
  ref->weight.copy_(lin->weight);
  ref->bias.copy_(lin->bias);
  const at::Tensor x = at::randn({3, 12});
  EXPECT_TRUE(at::equal(lin(x), ref(x)));

  Conv2d conv(2, 3, 3, 1);
  Materializer(*conv, 1).create_all(*conv);
  torch::nn::Conv2d cref(torch::nn::Conv2dOptions(2, 3, 3).padding(1));
  cref->weight.copy_(conv->weight);
  cref->bias.copy_(conv->bias);
  const at::Tensor img = at::randn({2, 2, 6, 6});
  EXPECT_TRUE(at::equal(conv(img), cref(img)));

  LayerNorm ln(std::vector<int64_t>{12});
  Materializer(*ln, 1).create_all(*ln);
  torch::nn::LayerNorm lref(torch::nn::LayerNormOptions({12}));
  EXPECT_TRUE(at::equal(ln(x), lref(x)));

  Embedding emb(10, 4);
  Materializer(*emb, 1).create_all(*emb);
  torch::nn::Embedding eref(10, 4);
  eref->weight.copy_(emb->weight);
  const at::Tensor ids = at::tensor({3, 0, 9}, at::kLong);
  EXPECT_TRUE(at::equal(emb(ids), eref(ids)));
  EXPECT_EQ(layer_text(*lin), "Linear(in_features=12, out_features=5, bias=true)");
}

// A layer run to be measured is created for the run and is a shape again after it, its
// bytes freed; a created layer is left as it is.
TEST(Init, AMaterializedScopeGivesTheBytesBack) {
  torch::nn::Sequential shapes = model_shapes(gpt(), text_info(16));
  auto block = shapes->ptr(1);
  {
    MaterializedScope scope(*block);
    EXPECT_GT(created_bytes(*block), 0);
    torch::nn::AnyModule& any = *(shapes->begin() + 1);
    at::Tensor out = any.forward(at::randn({2, 16, 32}));
    out.sum().backward();
    EXPECT_TRUE(block->parameters().front().grad().defined());
  }
  EXPECT_EQ(created_bytes(*shapes), 0);
  for (const auto& p : block->parameters()) {
    EXPECT_TRUE(p.is_meta());
    EXPECT_TRUE(p.requires_grad());
    EXPECT_FALSE(p.grad().defined());
  }
  // The probe runs every layer that way: shapes stay shapes.
  const LayerProbe probe = probe_layers(shapes, at::zeros({1, 16}, at::kLong));
  EXPECT_EQ(probe.layers.back().output.sizes(), (std::vector<int64_t>{1, 16, 256}));
  EXPECT_EQ(created_bytes(*shapes), 0);
  // Created afterwards, the model trains: autograd's leaves are the new tensors.
  Materializer(*shapes, 1).create_all(*shapes);
  shapes->forward(at::zeros({2, 16}, at::kLong)).sum().backward();
  for (const auto& p : shapes->parameters()) EXPECT_TRUE(p.grad().defined());
}

TEST(Init, AClonedShapeIsAShapeAndAClonedLayerHasItsValues) {
  torch::nn::Sequential shapes = model_shapes(gpt(), text_info(8));
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(shapes->clone());
  ASSERT_TRUE(copy);
  for (const auto& p : copy->parameters()) EXPECT_TRUE(p.is_meta());
  torch::nn::Sequential made = build_model(gpt(), text_info(8), 2);
  auto twin = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(made->clone());
  auto a = made->named_parameters(), b = twin->named_parameters();
  for (const auto& p : a) EXPECT_TRUE(at::equal(p.value(), b[p.key()])) << p.key();
}

// A program's model built of torch::nn layers comes with its values: nothing to draw.
// A meta tensor in a module that cannot say how to draw it is named.
TEST(Init, AProgramsOwnModel) {
  torch::nn::Sequential given(torch::nn::Linear(3, 2), torch::nn::ReLU());
  Materializer m(*given, 1);
  EXPECT_TRUE(m.given());
  at::Tensor out = at::empty({2});
  m.fill({"0.bias", given->named_parameters()["0.bias"]}, 1, out.narrow(0, 0, 1));
  EXPECT_EQ(out[0].item<float>(), given->named_parameters()["0.bias"][1].item<float>());

  struct OddImpl : torch::nn::Module {
    OddImpl() { register_parameter("w", at::empty({2}, at::kMeta)); }
    at::Tensor forward(const at::Tensor& x) { return x; }
  };
  torch::nn::Sequential odd;
  odd->push_back(std::make_shared<OddImpl>());
  try {
    Materializer bad(*odd, 1);
    FAIL() << "a meta tensor without a rule was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("0.w"), std::string::npos) << e.what();
  }
}

// Note [Placements] (core/placement.h): a rank's part of a split tensor maps its flat
// elements to the whole tensor's as the same box cut out of the whole with torch would;
// the Materializer draws a part as those elements of the whole tensor, so every
// tensor-parallel degree starts from the bytes one process holds.
namespace {

at::Tensor part_of_whole(const Placement& p) {
  at::Tensor whole = at::arange(p.whole_numel(), at::kLong).view(p.view);
  const int64_t block = p.is_split() ? p.view[static_cast<size_t>(p.dim)] / p.parts : 0;
  return p.is_split() ? whole.narrow(p.dim, p.index * block, block).contiguous().view({-1}) : whole.view({-1});
}

at::Tensor through_runs(const Placement& p, int64_t first, int64_t count) {
  at::Tensor out = at::full({count}, -1, at::kLong);
  for (const Placement::Run& r : p.runs(first, count))
    out.narrow(0, r.local_begin - first, r.length).copy_(at::arange(r.whole_begin, r.whole_begin + r.length, at::kLong));
  return out;
}

}  // namespace

TEST(Placement, RunsAreTheElementsTheBoxHoldsInTheWhole) {
  const std::vector<Placement> cases = {
      Placement::split({12, 5}, 0, 3, 1),      // column-parallel: a block of rows
      Placement::split({4, 6}, 1, 2, 1),       // row-parallel: a block of columns, one run per row
      Placement::split({3, 8, 4}, 1, 4, 2),    // fused qkv [3d, d] as [3, d, d], by heads
      Placement::split({2, 3, 6, 5}, 2, 3, 0), // dim in the middle of four
      Placement::split({10}, 0, 5, 4),         // a bias
      Placement::split({7, 3}, 0, 1, 0),       // one part: the whole
      Placement::whole({3, 4}),
  };
  for (const Placement& p : cases) {
    SCOPED_TRACE(p.str());
    const at::Tensor expect = part_of_whole(p);
    ASSERT_EQ(expect.numel(), p.local_numel());
    EXPECT_TRUE(at::equal(through_runs(p, 0, p.local_numel()), expect));
    for (int64_t first = 0; first < p.local_numel(); first += 3)
      for (int64_t count : {int64_t{1}, int64_t{4}, p.local_numel() - first}) {
        count = std::min(count, p.local_numel() - first);
        EXPECT_TRUE(at::equal(through_runs(p, first, count), expect.narrow(0, first, count)))
            << "[" << first << ", " << first + count << ")";
      }
  }
  EXPECT_EQ(Placement::split({4, 6}, 1, 2, 1).runs(0, 12).size(), 4u);  // a row of 3 per row of 4
  EXPECT_EQ(Placement::split({12, 5}, 0, 3, 1).runs(0, 20).size(), 1u);
  EXPECT_THROW(Placement::split({4, 6}, 1, 4, 0), tetra::Error);          // 4 does not divide 6
  EXPECT_THROW(Placement::split({4, 6}, 1, 2, 1).runs(10, 3), tetra::Error);
}

namespace {

// A module of one tensor-parallel weight, built as a shape: its part only.
struct PartImpl : torch::nn::Module, Initialized {
  PartImpl(Placement part, Init init) : part_(std::move(part)), init_(init) {
    register_parameter("w", at::empty(part_.local(), at::TensorOptions().dtype(at::kFloat).device(at::kMeta)));
  }
  Init init_of(const std::string&) const override { return init_; }
  std::optional<Placement> placement_of(const std::string&) const override { return part_; }
  at::Tensor forward(const at::Tensor& x) { return x; }
  Placement part_;
  Init init_;
};

}  // namespace

TEST(Init, APartDrawsTheWholeTensorsElementsThere) {
  const std::vector<int64_t> view = {3, 8, 6};  // a fused [3d, d] weight, d = 8, by heads
  const std::string name = "0.w";               // the tensor's single-process name
  for (const Init& init : {Init::normal(0, 0.02), Init::uniform(-0.5, 0.5)}) {
    at::Tensor whole = at::empty({3 * 8 * 6});
    draw(init, 11, name, 0, whole);
    for (int index = 0; index < 4; ++index) {
      SCOPED_TRACE(init.str() + ", part " + std::to_string(index));
      const Placement part = Placement::split(view, 1, 4, index);
      torch::nn::Sequential model;
      model->push_back(std::make_shared<PartImpl>(part, init));
      Materializer m(*model, 11);
      ASSERT_NE(m.placement(name), nullptr);
      const at::Tensor expect = whole.view(view).narrow(1, 2 * index, 2).contiguous();
      const at::Tensor p = model->named_parameters()[name];
      // fill: ranges of the part (a ZeRO chunk of it), odd starts included.
      for (int64_t first : {0, 1, 5, 13, 23}) {
        at::Tensor out = at::empty({std::min<int64_t>(13, part.local_numel() - first)});
        m.fill({name, p}, first, out);
        EXPECT_TRUE(at::equal(out, expect.view({-1}).narrow(0, first, out.numel()))) << "first " << first;
      }
      // create: the part, in its own shape.
      m.create_all(*model);
      EXPECT_TRUE(at::equal(model->named_parameters()[name], expect));
    }
  }
  // The module's part must have the shape its placement gives.
  torch::nn::Sequential wrong;
  auto bad = std::make_shared<PartImpl>(Placement::split(view, 1, 4, 0), Init::normal(0, 1));
  bad->part_ = Placement::split(view, 1, 2, 0);
  wrong->push_back(bad);
  try {
    Materializer m(*wrong, 1);
    FAIL() << "a part of the wrong shape was accepted";
  } catch (const tetra::Error& e) {
    EXPECT_NE(std::string(e.what()).find("0.w"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("split along 1 into 2"), std::string::npos) << e.what();
  }
}

// generate — text from a trained gpt, one byte at a time with a key-value cache.
//
//   generate RUN_OR_CHECKPOINT --prompt TEXT [--tokens N] [--temperature T] [--top-k K]
//            [--seed S] [--device cpu|cuda] [--threads N] [--logits FILE]
//
// RUN_OR_CHECKPOINT: a run folder (runs/NAME: its newest checkpoint, else its export), a
// checkpoint folder of any layout (the weights are whole whatever wrote them), or a tetra
// safetensors export with its config. The prompt's bytes are the first tokens (the gpt's
// vocabulary is bytes); the text goes to stdout, prompt first, and the figures to stderr.
//
// Sampling: logits / T, the K most likely kept (0: all), a draw from their softmax by a
// generator of its own seeded with S (SplitMix64, the same on every machine and device);
// T = 0 takes the most likely byte. A seed gives the same text every time, from a
// checkpoint of any layout. A sequence that fills the context (data.seq_len) goes on from
// the second half of it, recomputed, as training never saw positions beyond it.
// --logits FILE writes the prompt's logits, [positions][vocab] as JSON, from the model's
// whole forward (no cache): what another implementation of the same weights must give
// (tools/gpu/hf_check.py compares Hugging Face's GPT-2 with them).
//
// Exit status: 0 done; 2 the command line, the path or the model is wrong ("generate:
// error: ...", naming it).
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "collectives/error.h"
#include "core/model_io.h"
#include "core/models.h"
#include "core/random.h"
#include "core/runtime.h"

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// A uniform double in [0, 1) from SplitMix64's stream at `state` (advanced).
double uniform(uint64_t& state) {
  state += 0x9E3779B97F4A7C15ULL;
  return static_cast<double>(tetra::core::splitmix64(state) >> 11) * 0x1.0p-53;
}

// The next token from `logits` [vocab] (any device).
int64_t sample(const torch::Tensor& logits, double temperature, int64_t top_k, uint64_t& state) {
  const torch::Tensor l = logits.detach().to(torch::kCPU, torch::kDouble).contiguous();
  const double* v = l.data_ptr<double>();
  const int64_t n = l.numel();
  if (temperature <= 0) return l.argmax().item<int64_t>();
  double cut = -std::numeric_limits<double>::infinity();
  if (top_k > 0 && top_k < n) cut = std::get<0>(l.topk(top_k)).min().item<double>();
  double most = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i)
    if (v[i] >= cut) most = std::max(most, v[i]);
  std::vector<double> p(static_cast<size_t>(n), 0.0);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i)
    if (v[i] >= cut) sum += p[static_cast<size_t>(i)] = std::exp((v[i] - most) / temperature);
  double u = uniform(state) * sum;
  for (int64_t i = 0; i < n; ++i) {
    u -= p[static_cast<size_t>(i)];
    if (u < 0 && p[static_cast<size_t>(i)] > 0) return i;
  }
  for (int64_t i = n - 1; i >= 0; --i)  // rounding left u at the top: the last kept one
    if (p[static_cast<size_t>(i)] > 0) return i;
  return 0;
}

torch::Tensor tokens_of(const std::vector<int64_t>& t) { return torch::tensor(t, torch::kLong); }

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"generate: text from a trained gpt (a run folder, a checkpoint of any layout, or an export)",
               "generate"};
  std::string path, prompt, device = "cpu", logits_file;
  int64_t tokens = 256, top_k = 0;
  double temperature = 1.0;
  uint64_t seed = 0;
  int threads = 1;
  app.add_option("path", path, "a run folder, a checkpoint folder or a safetensors export")->required();
  app.add_option("--prompt", prompt, "the text to continue (its bytes are the first tokens)")->required();
  app.add_option("--tokens", tokens, "how many tokens (bytes) to generate (default 256)")->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--temperature", temperature, "divides the logits; 0 takes the most likely (default 1)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--top-k", top_k, "sample among the K most likely (default 0: all)")->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--seed", seed, "the sampling seed (default 0): the same seed, the same text");
  app.add_option("--device", device, "cpu (default) or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--logits", logits_file, "write the prompt's logits [positions][vocab] as JSON to this file");
  app.add_option("--threads", threads,
                 "intra-op threads (default 1: each new token's products are matrix-vector, bound by memory, and "
                 "more threads measured slower here; 0: the cores)")->check(CLI::Range(0, 4096));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    tetra::core::tune_allocator();
    tetra::core::set_threads(threads);
    if (prompt.empty()) throw tetra::Error("--prompt needs at least one byte: the first token the model continues");
    if (device == "cuda" && !torch::cuda::is_available())
      throw tetra::Error("--device cuda, and LibTorch sees no CUDA device here (torch::cuda::is_available() is false)");
    const auto t_load = Clock::now();
    tetra::core::LoadedModel loaded = tetra::core::load_model(path);
    if (loaded.spec.type != "gpt")
      throw tetra::Error(loaded.source + " holds a model.type " + loaded.spec.type + ": generate needs a gpt");
    if (device == "cuda") loaded.model->to(torch::Device(torch::kCUDA));
    tetra::core::GptDecoder decoder(loaded.model);
    const double load_s = seconds_since(t_load);

    std::vector<int64_t> text;
    for (unsigned char c : prompt) text.push_back(c);
    const int64_t context = decoder.context();
    size_t start = 0;  // the first token the decoder holds
    if (static_cast<int64_t>(text.size()) > context) {
      start = text.size() - static_cast<size_t>(context);
      std::fprintf(stderr, "generate: the prompt's %zu bytes exceed the context of %lld: the model sees its last %lld\n",
                   text.size(), static_cast<long long>(context), static_cast<long long>(context));
    }
    if (!logits_file.empty()) {
      torch::NoGradGuard no_grad;
      const torch::Tensor ids = tokens_of(std::vector<int64_t>(text.begin() + static_cast<long>(start), text.end()));
      const torch::Tensor all = loaded.model->forward(ids.unsqueeze(0).to(device == "cuda" ? torch::kCUDA : torch::kCPU))[0]
                                    .to(torch::kCPU, torch::kDouble).contiguous();
      nlohmann::json rows = nlohmann::json::array();
      for (int64_t t = 0; t < all.size(0); ++t) {
        const double* v = all[t].data_ptr<double>();
        rows.push_back(std::vector<double>(v, v + all.size(1)));
      }
      std::ofstream out(logits_file);
      if (!(out << rows.dump() << "\n")) throw tetra::Error("cannot write --logits " + logits_file);
    }
    uint64_t state = seed;
    const auto t_prompt = Clock::now();
    torch::Tensor logits = decoder.next(tokens_of(std::vector<int64_t>(text.begin() + static_cast<long>(start), text.end())));
    const double prompt_s = seconds_since(t_prompt);
    bool slid = false;
    const auto t_gen = Clock::now();
    for (int64_t i = 0; i < tokens; ++i) {
      const int64_t next = sample(logits, temperature, top_k, state);
      text.push_back(next);
      if (i + 1 == tokens) break;
      if (decoder.length() == context) {
        // Full: go on from the second half of the context, recomputed.
        const size_t keep = static_cast<size_t>(std::max<int64_t>(1, context / 2));
        decoder.reset();
        logits = decoder.next(tokens_of(std::vector<int64_t>(text.end() - static_cast<long>(keep), text.end())));
        slid = true;
      } else {
        logits = decoder.next(tokens_of({next}));
      }
    }
    const double gen_s = seconds_since(t_gen);
    std::string out;
    for (int64_t t : text) out += static_cast<char>(t);
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fputc('\n', stdout);
    std::fflush(stdout);
    std::fprintf(stderr,
                 "generate: %lld tokens in %.3f s: %.1f tokens/s (the prompt's %zu in %.1f ms; loaded in %.2f s) on "
                 "%s, %lld threads; step %lld of %s%s\n",
                 static_cast<long long>(tokens), gen_s, gen_s > 0 ? static_cast<double>(tokens) / gen_s : 0.0,
                 prompt.size() - start, prompt_s * 1e3, load_s, device.c_str(),
                 static_cast<long long>(torch::get_num_threads()), static_cast<long long>(loaded.step),
                 loaded.source.c_str(), slid ? "; the context filled, and went on from its second half" : "");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "generate: error: %s\n", e.what());
    return 2;
  }
}

#include "core/checkpoint.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "collectives/error.h"

namespace tetra::core {

namespace fs = std::filesystem;

namespace {

constexpr const char* kMeta = "meta.json";
constexpr const char* kRankFile = "rank-00000.safetensors";

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

bool is_step_dir(const fs::directory_entry& e) {
  const std::string n = e.path().filename().string();
  return e.is_directory() && n.rfind("step-", 0) == 0 && fs::exists(e.path() / kMeta);
}

std::vector<std::string> step_dirs(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (is_step_dir(e)) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());  // zero-padded step numbers sort in step order
  return out;
}

}  // namespace

CheckpointStore::CheckpointStore(std::string dir, int64_t keep) : dir_(std::move(dir)), keep_(keep) {}

std::vector<std::string> CheckpointStore::list() const { return step_dirs(dir_); }

std::optional<std::string> CheckpointStore::latest() const {
  auto all = list();
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::string CheckpointStore::save(const Checkpoint& ckpt) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw Error("checkpoint: cannot create " + dir_ + ": " + ec.message());
  const std::string name = step_name(ckpt.step);
  const fs::path final_dir = fs::path(dir_) / name;
  const fs::path tmp_dir = fs::path(dir_) / ("." + name + ".tmp");
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  if (ec) throw Error("checkpoint: cannot create " + tmp_dir.string() + ": " + ec.message());

  save_safetensors((tmp_dir / kRankFile).string(), ckpt.tensors);
  nlohmann::json meta = ckpt.meta;
  meta["format"] = "tetra-checkpoint-1";
  meta["step"] = ckpt.step;
  meta["epoch"] = ckpt.epoch;
  meta["step_in_epoch"] = ckpt.step_in_epoch;
  meta["files"] = {kRankFile};
  write_file_atomic((tmp_dir / kMeta).string(), meta.dump(2) + "\n");
  fsync_dir(tmp_dir.string());

  // Replace an older checkpoint of the same step (a rerun) only once the new one is whole.
  if (fs::exists(final_dir)) fs::remove_all(final_dir, ec);
  fs::rename(tmp_dir, final_dir, ec);
  if (ec) throw Error("checkpoint: cannot rename " + tmp_dir.string() + ": " + ec.message());
  fsync_dir(dir_);

  // Keep the newest K; drop temporaries a killed run left behind.
  auto all = list();
  for (size_t i = 0; i + static_cast<size_t>(keep_) < all.size(); ++i) fs::remove_all(all[i], ec);
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 4 && n[0] == '.' && n.rfind(".tmp") == n.size() - 4 && e.path() != tmp_dir)
      fs::remove_all(e.path(), ec);
  }
  return final_dir.string();
}

std::optional<std::string> CheckpointStore::resolve(const std::string& path) {
  std::error_code ec;
  if (fs::exists(fs::path(path) / kMeta, ec)) return path;
  auto all = step_dirs(path);
  if (all.empty()) return std::nullopt;
  return all.back();
}

Checkpoint CheckpointStore::load(const std::string& path) {
  auto dir = resolve(path);
  if (!dir) throw Error("checkpoint: no checkpoint at " + path + " (expected a step-* folder with " + kMeta + ")");
  Checkpoint ckpt;
  std::ifstream in(fs::path(*dir) / kMeta);
  try {
    in >> ckpt.meta;
  } catch (const std::exception& e) {
    throw Error("checkpoint: " + (fs::path(*dir) / kMeta).string() + " is damaged: " + e.what());
  }
  if (ckpt.meta.value("format", "") != "tetra-checkpoint-1")
    throw Error("checkpoint: " + *dir + " is not a tetra checkpoint (format \"" +
                ckpt.meta.value("format", "") + "\")");
  ckpt.step = ckpt.meta.value("step", int64_t{0});
  ckpt.epoch = ckpt.meta.value("epoch", int64_t{0});
  ckpt.step_in_epoch = ckpt.meta.value("step_in_epoch", int64_t{0});
  ckpt.tensors = load_safetensors((fs::path(*dir) / kRankFile).string());
  return ckpt;
}

}  // namespace tetra::core

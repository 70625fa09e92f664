// flight — reads the flight-recorder dumps of a job's ranks and says what happened.
//
//   flight runs/job/flight                 every flight-*.json in the folder
//   flight a.json b.json ...               these dumps
//   flight --json runs/job/flight          the dumps merged into one JSON document
//
// Each process of a job writes its dump (Note [Flight recorder] in
// collectives/flight_recorder.h) on a timeout, at a stall warning, on SIGUSR1, and when a
// peer is lost. This tool lines the ranks' records up by group and sequence number and
// prints one finding a line, the most telling first, e.g.
//
//   rank 3 (host h, pid p) never entered allreduce sum #1842 on data (rank 0 ..., rank 1
//   ... and rank 2 ... waiting 63 s); its last op was send #77 on pipeline ... to rank 1
//
// Exit status: 0 read and analysed; 2 the command line or a dump is wrong (missing, not
// JSON, not a dump), with the file named on stderr.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "collectives/flight_recorder.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{"flight: what the ranks of a job were doing, from their flight-recorder dumps", "flight"};
  std::vector<std::string> inputs;
  bool json = false;
  app.add_option("inputs", inputs, "dump files, or folders of flight-*.json")->required();
  app.add_flag("--json", json, "print the dumps merged into one JSON document instead");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  std::vector<fs::path> files;
  for (const auto& in : inputs) {
    std::error_code ec;
    if (fs::is_directory(in, ec)) {
      std::vector<fs::path> found;
      for (const auto& e : fs::directory_iterator(in, ec)) {
        const std::string name = e.path().filename().string();
        if (name.rfind("flight-", 0) == 0 && e.path().extension() == ".json") found.push_back(e.path());
      }
      if (found.empty()) {
        std::fprintf(stderr, "flight: %s holds no flight-*.json dump\n", in.c_str());
        return 2;
      }
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else if (fs::exists(in, ec)) {
      files.emplace_back(in);
    } else {
      std::fprintf(stderr, "flight: %s: no such file or folder\n", in.c_str());
      return 2;
    }
  }
  std::vector<nlohmann::json> dumps;
  for (const auto& f : files) {
    std::ifstream in(f);
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("recorders")) {
      std::fprintf(stderr, "flight: %s is not a flight-recorder dump (JSON with \"recorders\")\n", f.c_str());
      return 2;
    }
    dumps.push_back(std::move(j));
  }
  if (json) {
    std::printf("%s\n", nlohmann::json(dumps).dump(1).c_str());
    return 0;
  }
  std::printf("%zu dump%s: ", dumps.size(), dumps.size() == 1 ? "" : "s");
  for (size_t i = 0; i < dumps.size(); ++i)
    std::printf("%s%s (%s)", i ? ", " : "", files[i].filename().c_str(), dumps[i].value("reason", std::string("?")).c_str());
  std::printf("\n%s", tetra::collectives::analyze(dumps).c_str());
  return 0;
}

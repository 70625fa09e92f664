// The environment's knobs (Note [Knobs declared once]): each declared once and described,
// read the way the old readers read them, README's table generated from them, and no
// production file that reads the environment around them.
#include "hardware/env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace env = tetra::env;
namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Sets (or unsets, with nullptr) a variable for one scope, and puts it back after.
class ScopedVar {
 public:
  ScopedVar(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    if (value)
      ::setenv(name, value, 1);
    else
      ::unsetenv(name);
  }
  ~ScopedVar() {
    if (had_)
      ::setenv(name_.c_str(), old_.c_str(), 1);
    else
      ::unsetenv(name_.c_str());
  }

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace

TEST(Env, EveryKnobIsNamedOnceAndDescribed) {
  std::set<std::string> names;
  bool others_began = false;
  const std::regex name_shape("[A-Z][A-Za-z0-9_]*");
  for (const env::Knob* k : env::knobs()) {
    SCOPED_TRACE(k->name);
    EXPECT_TRUE(names.insert(k->name).second) << "declared twice";
    EXPECT_TRUE(std::regex_match(k->name, name_shape));
    EXPECT_EQ(k->own(), std::string(k->name).rfind("TETRA_", 0) == 0) << "tetra's own are TETRA_*, and only they";
    // tetra's own come first, so that the help and README list them as one group.
    if (!k->own()) others_began = true;
    EXPECT_FALSE(k->own() && others_began) << "tetra's own come before the other tools'";
    EXPECT_FALSE(std::string(k->tool).empty());
    const std::string what = k->what;
    ASSERT_GE(what.size(), 10u) << "every knob says what it does";
    EXPECT_EQ(what.back(), '.');
    // Written into README's Markdown table as it is.
    EXPECT_EQ(what.find_first_of("|<>"), std::string::npos);
    const std::string fallback = k->fallback;
    if (k->kind == env::Kind::kInteger && !fallback.empty()) {
      EXPECT_TRUE(std::regex_match(fallback, std::regex("-?[0-9]+"))) << "the default " << fallback;
    }
    if (k->kind == env::Kind::kFlag) {
      EXPECT_TRUE(fallback.empty() || fallback == "0" || fallback == "1");
    }
  }
  EXPECT_GT(names.size(), 50u);
}

// A knob defined in env.cpp but left out of knobs() would be read but never listed.
TEST(Env, EveryDefinitionIsListed) {
  const std::string source = slurp(fs::path(TETRA_SOURCE_DIR) / "hardware" / "env.cpp");
  const std::regex definition(R"re(constexpr Knob (k\w+)\{key, "(\w+)")re");
  std::set<std::string> defined;
  for (auto it = std::sregex_iterator(source.begin(), source.end(), definition); it != std::sregex_iterator(); ++it)
    defined.insert((*it)[2]);
  std::set<std::string> listed;
  for (const env::Knob* k : env::knobs()) listed.insert(k->name);
  EXPECT_EQ(defined, listed);
}

TEST(Env, AccessorsReadAsTheOldReadersDid) {
  {
    ScopedVar v("TETRA_FLIGHT_RECORDER_ENTRIES", nullptr);
    EXPECT_EQ(env::integer(env::kFlightRecorderEntries, 1), 4096);
    EXPECT_FALSE(env::get(env::kFlightRecorderEntries));
  }
  for (const char* bad : {"", "0", "-3", "12x", "x", " "}) {
    ScopedVar v("TETRA_FLIGHT_RECORDER_ENTRIES", bad);
    EXPECT_EQ(env::integer(env::kFlightRecorderEntries, 1), 4096) << "'" << bad << "'";
  }
  {
    ScopedVar v("TETRA_FLIGHT_RECORDER_ENTRIES", "17");
    EXPECT_EQ(env::integer(env::kFlightRecorderEntries, 1), 17);
    EXPECT_EQ(*env::get(env::kFlightRecorderEntries), "17");
  }
  {
    // A knob with no default reads 0 when unset or malformed (the local sizes).
    ScopedVar v("MPI_LOCALNRANKS", "two");
    EXPECT_EQ(env::integer(env::kMpiLocalNRanks, 1), 0);
  }
  {
    // Set to nothing is set for get() and is_set(), unset for text().
    ScopedVar v("CUDA_VISIBLE_DEVICES", "");
    ASSERT_TRUE(env::get(env::kCudaVisibleDevices));
    EXPECT_EQ(*env::get(env::kCudaVisibleDevices), "");
    EXPECT_TRUE(env::is_set(env::kCudaVisibleDevices));
    EXPECT_EQ(env::text(env::kCudaVisibleDevices), "");
  }
  {
    ScopedVar v("TETRA_MPI_POLL", "");
    EXPECT_EQ(env::text(env::kMpiPoll), "100,5000,50,20");
  }
  for (const char* on : {"1", "on", "true"}) {
    ScopedVar v("TETRA_MALLOC_MMAP", on);
    EXPECT_TRUE(env::flag(env::kMallocMmap)) << on;
  }
  for (const char* off : {"0", "off", "yes", "", "TRUE"}) {
    ScopedVar v("TETRA_MALLOC_MMAP", off);
    EXPECT_FALSE(env::flag(env::kMallocMmap)) << off;
  }
  {
    ScopedVar v("TETRA_MALLOC_MMAP", nullptr);
    EXPECT_FALSE(env::flag(env::kMallocMmap));
  }
  // Reading a knob as another kind is tetra's bug, said at once.
  EXPECT_THROW(env::flag(env::kMonitorPort), std::logic_error);
  EXPECT_THROW(env::integer(env::kMallocMmap), std::logic_error);
}

TEST(Env, SetLeavesAValueAloneWithoutOverwrite) {
  ScopedVar v("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "2");
  env::set(env::kOmpiIallreduceAlgorithm, "1", /*overwrite=*/false);
  EXPECT_EQ(env::text(env::kOmpiIallreduceAlgorithm), "2");
  env::set(env::kOmpiIallreduceAlgorithm, "3");
  EXPECT_EQ(env::text(env::kOmpiIallreduceAlgorithm), "3");
}

TEST(Env, HelpNamesEveryKnobWithItsKindAndDefault) {
  const std::string help = env::help_text();
  const size_t others = help.find("\nOther tools'");
  ASSERT_NE(others, std::string::npos) << help;
  for (const env::Knob* k : env::knobs()) {
    const size_t at = help.find(std::string("\n  ") + k->name + "  ");
    ASSERT_NE(at, std::string::npos) << k->name;
    const std::string line = help.substr(at + 1, help.find('\n', at + 1) - at - 1);
    EXPECT_NE(line.find(std::string("  ") + env::kind_name(k->kind)), std::string::npos) << line;
    if (*k->fallback) {
      EXPECT_NE(line.find(std::string("default ") + k->fallback), std::string::npos) << line;
    }
    EXPECT_EQ(at < others, k->own()) << k->name << " in the wrong group";
  }
  for (size_t at = 0, nl; at < help.size(); at = nl + 1) {
    nl = help.find('\n', at);
    EXPECT_LE(nl - at, 100u) << help.substr(at, nl - at);
  }
}

// README's table is env::markdown() between its markers: regenerate it from the
// expected text this prints when a knob changes.
TEST(Env, ReadmeTableIsTheDeclarations) {
  const std::string readme = slurp(fs::path(TETRA_SOURCE_DIR) / "README.md");
  const std::string begin = "<!-- env-table begin: generated by env::markdown() (hardware/env.cpp) -->\n";
  const std::string end = "<!-- env-table end -->";
  const size_t b = readme.find(begin), e = readme.find(end);
  ASSERT_NE(b, std::string::npos) << "README.md lacks the line " << begin;
  ASSERT_NE(e, std::string::npos) << "README.md lacks the line " << end;
  ASSERT_LT(b, e);
  const std::string table = readme.substr(b + begin.size(), e - b - begin.size());
  EXPECT_EQ(table, "\n" + env::markdown() + "\n") << "README.md's environment table differs from the declarations; "
                                                     "between its markers it should read:\n\n"
                                                  << env::markdown();
}

// Every production read of the environment goes through env.h (Note [Knobs declared
// once]).
TEST(Env, NoProductionFileReadsTheEnvironmentItself) {
  const std::set<std::string> allowed = {"hardware/env.cpp"};
  const std::regex call(R"(\b(secure_getenv|getenv|setenv|unsetenv|putenv)\s*\()");
  // The whole environment, handed on to a child (report's rsvg-convert) and read by no one.
  const std::set<std::string> hands_on_environ = {"tools/report.cpp"};
  const std::regex environ_use(R"(\benviron\b)");
  std::set<std::string> still_reading;
  const fs::path root = TETRA_SOURCE_DIR;
  for (const char* dir : {"hardware", "collectives", "core", "data_parallel", "pipeline", "zero", "replicate",
                          "tensor_parallel", "expert_parallel", "tools"}) {
    if (!fs::exists(root / dir)) continue;
    for (const auto& e : fs::recursive_directory_iterator(root / dir)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".cpp" && ext != ".h")) continue;
      const std::string rel = fs::relative(e.path(), root).generic_string();
      const std::string text = slurp(e.path());
      if (std::regex_search(text, environ_use) && !hands_on_environ.count(rel))
        ADD_FAILURE() << rel << " reads `environ`: read declared knobs through hardware/env.h instead";
      if (!std::regex_search(text, call)) continue;
      if (allowed.count(rel))
        still_reading.insert(rel);
      else
        ADD_FAILURE() << rel << " reads or sets the environment itself: declare the variable in hardware/env.cpp "
                      << "and use env::text, flag, integer, get or set";
    }
  }
  for (const std::string& a : allowed)
    EXPECT_TRUE(still_reading.count(a)) << a << " no longer reads the environment itself: drop it from `allowed`";
}

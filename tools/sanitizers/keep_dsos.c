// LD_PRELOADed into the processes of tools/sanitize.sh asan: dlclose() that keeps the
// library mapped. Open MPI loads its components (mca_btl_vader.so, mca_pml_ob1.so, ...)
// with dlopen and unloads them in MPI_Finalize; what they allocated for the process
// lifetime is then reported by LeakSanitizer at exit with frames of "<unknown module>",
// which no suppression can name. Kept mapped, those frames read mca_*.so and lsan.supp's
// entries for Open MPI apply. Nothing else changes: a library closed this way was about
// to go away with the process anyway.
int dlclose(void* handle) {
  (void)handle;
  return 0;
}

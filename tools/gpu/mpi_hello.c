/* The GPU check's proof that the carried Open MPI starts ranks that meet: compiled with
   the carried mpicc, run as `mpirun -np 2 mpi_hello`; each rank prints its rank, the
   world size and the sum of every rank's number (1 for two ranks). */
#include <mpi.h>
#include <stdio.h>

int main(int argc, char** argv) {
  int rank = 0, size = 0, sum = 0;
  if (MPI_Init(&argc, &argv) != MPI_SUCCESS) return 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS) return 1;
  printf("rank %d of %d: sum %d\n", rank, size, sum);
  MPI_Finalize();
  return 0;
}

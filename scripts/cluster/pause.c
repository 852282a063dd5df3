/* The pod sandbox process (what registry.k8s.io/pause runs; there is no registry here): hold the pod's namespaces,
 * reap zombies, exit on SIGINT/SIGTERM. Built static by scripts/cluster/pause-image.sh. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_term(int sig) { (void)sig; _exit(0); }
static void on_child(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }

int main(void) {
  struct sigaction term = {.sa_handler = on_term}, child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &term, NULL) < 0 || sigaction(SIGTERM, &term, NULL) < 0 || sigaction(SIGCHLD, &child, NULL) < 0)
    return 1;
  for (;;) pause();
}

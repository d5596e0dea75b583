// treeserve: the server executable.
#include "server/app.h"

int main(int argc, char** argv) { return treeserve::run_treeserve(argc, argv); }

// trainer.h: the training entry points of ./train (see train/main.cpp).
#pragma once

namespace loom {

int train_command(int argc, char** argv);  // ./train CONFIG [--section.key=value ...]
int chat_command(int argc, char** argv);   // ./train chat CHECKPOINT --image IMG

}  // namespace loom

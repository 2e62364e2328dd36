"""A compiled artifact at run time: the manifest, the TVM runtime libraries (no compiler), the device,
the ELF check, and loading the library with its weights bound."""

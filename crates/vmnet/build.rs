//! Link the `vmnet` binary with packed relative relocations (`DT_RELR`, glibc 2.36 and later):
//! the dynamic loader reads a few kilobytes of relocation bitmaps at every start instead of
//! about 0.8 MB of `Elf64_Rela` entries, which a CLI called once per VM pays each time.

fn main() {
    println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
}

// Command gendocs writes the configuration reference (docs/configuration.md) from the proxy's
// flag set. Run it from the repository's root after changing a flag or its help:
//
//	go run ./hack/gendocs
//
// The app package's TestConfigurationDocIsGenerated fails while the file and the flag set differ.
package main

import (
	"flag"
	"fmt"
	"os"

	"github.com/kube-userspace-proxy/kube-userspace-proxy/cmd/kube-userspace-proxy/app"
)

func main() {
	fs := flag.NewFlagSet("gendocs", flag.ExitOnError)
	out := fs.String("o", app.ConfigurationDoc, "file to write")
	_ = fs.Parse(os.Args[1:])
	if err := os.WriteFile(*out, app.ConfigurationReference(), 0o644); err != nil {
		fmt.Fprintf(os.Stderr, "gendocs: write %s: %v\n", *out, err)
		os.Exit(1)
	}
}

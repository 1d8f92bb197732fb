package tcp

import (
	"fmt"
	"os"
	"testing"
)

// childEnv names the environment variable that turns the test binary into a helper process
// (see TestMain); its value picks the helper.
const childEnv = "KUP_FORWARD_CHILD"

func TestMain(m *testing.M) {
	switch helper := os.Getenv(childEnv); helper {
	case "":
		os.Exit(m.Run())
	case "splice":
		os.Exit(spliceChild())
	case "emfile":
		os.Exit(emfileChild())
	case "adopt":
		os.Exit(adoptChild())
	default:
		fmt.Fprintf(os.Stderr, "unknown %s=%q\n", childEnv, helper)
		os.Exit(2)
	}
}

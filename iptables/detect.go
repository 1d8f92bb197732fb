package iptables

import (
	"bytes"
	"fmt"
	"os/exec"
	"strings"
)

// hintChains are the chains kubelet creates in the mangle table of the backend it uses; their
// presence settles which backend the node uses.
var hintChains = []string{"KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"}

// DetectMode picks the backend the host already uses, the way kube-proxy's iptables wrapper does:
//  1. the backend holding kubelet's hint chains (KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY);
//  2. else the backend holding more rules of Kubernetes (chains or jumps named KUBE-*);
//  3. else the backend holding more rules;
//  4. else the backend `iptables --version` reports (nf_tables or legacy).
//
// It reads both families' rules with iptables-legacy-save and iptables-nft-save (a missing tool
// counts as no rules). reason says which step decided, for the log.
func DetectMode() (mode Mode, reason string, err error) {
	return detectMode(runTool)
}

// toolRunner starts a command and returns a function that waits for it and returns its standard
// output.
type toolRunner func(name string, args ...string) (wait func() ([]byte, error))

// runTool starts the command in the calling goroutine's thread (so that it runs in that thread's
// network namespace, which tests set) and returns the wait.
func runTool(name string, args ...string) func() ([]byte, error) {
	var stdout, stderr bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		return func() ([]byte, error) { return nil, fmt.Errorf("run %s: %w", name, err) }
	}
	return func() ([]byte, error) {
		if err := cmd.Wait(); err != nil {
			return stdout.Bytes(), fmt.Errorf("run %s: %w: %s", name, err, strings.TrimSpace(stderr.String()))
		}
		return stdout.Bytes(), nil
	}
}

func detectMode(run toolRunner) (Mode, string, error) {
	// The five tools run at once (each takes a few tens of milliseconds, and a restarted proxy
	// serves nothing until it knows the backend), all started from this goroutine.
	tools := []string{binaryName(IPv4, ModeLegacy, "-save"), binaryName(IPv4, ModeNFT, "-save"),
		binaryName(IPv6, ModeLegacy, "-save"), binaryName(IPv6, ModeNFT, "-save")}
	waits := make([]func() ([]byte, error), 0, len(tools)+1)
	for _, name := range tools {
		waits = append(waits, run(name))
	}
	waits = append(waits, run("iptables", "--version"))
	type result struct {
		out []byte
		err error
	}
	results := make([]result, len(waits))
	for i, wait := range waits {
		results[i].out, results[i].err = wait()
	}
	var legacy, nft []byte
	for i, r := range results[:len(tools)] {
		// Errors mean "no rules here" (tool missing, backend not usable in this kernel).
		if r.err != nil {
			continue
		}
		if i%2 == 0 {
			legacy = append(legacy, r.out...)
		} else {
			nft = append(nft, r.out...)
		}
	}
	var fallback Mode
	out, verr := results[len(tools)].out, results[len(tools)].err
	if verr == nil {
		fallback = modeFromVersion(string(out))
	}
	if fallback == "" {
		if _, err := exec.LookPath(binaryName(IPv4, ModeNFT, "")); err == nil {
			fallback = ModeNFT
		} else if _, err := exec.LookPath(binaryName(IPv4, ModeLegacy, "")); err == nil {
			fallback = ModeLegacy
		}
	}
	mode, reason := chooseMode(legacy, nft, fallback)
	if mode == "" {
		return "", "", fmt.Errorf("no iptables backend found (iptables --version: %v)", verr)
	}
	return mode, reason, nil
}

// modeFromVersion reads the backend from `iptables --version` ("iptables v1.8.9 (nf_tables)",
// "iptables v1.8.9 (legacy)"; versions before 1.8 print no backend and are legacy).
func modeFromVersion(v string) Mode {
	switch {
	case strings.Contains(v, "nf_tables"):
		return ModeNFT
	case strings.Contains(v, "iptables v"):
		return ModeLegacy
	}
	return ""
}

// chooseMode decides between the backends given both backends' iptables-save output.
func chooseMode(legacySave, nftSave []byte, fallback Mode) (Mode, string) {
	lh, nh := hasHint(legacySave), hasHint(nftSave)
	switch {
	case nh && !lh:
		return ModeNFT, "kubelet hint chain in nft"
	case lh && !nh:
		return ModeLegacy, "kubelet hint chain in legacy"
	}
	lk, lr := countRules(legacySave)
	nk, nr := countRules(nftSave)
	switch {
	case lk > nk:
		return ModeLegacy, fmt.Sprintf("more KUBE- rules in legacy (%d) than nft (%d)", lk, nk)
	case nk > lk:
		return ModeNFT, fmt.Sprintf("more KUBE- rules in nft (%d) than legacy (%d)", nk, lk)
	case lr > nr:
		return ModeLegacy, fmt.Sprintf("more rules in legacy (%d) than nft (%d)", lr, nr)
	case nr > lr:
		return ModeNFT, fmt.Sprintf("more rules in nft (%d) than legacy (%d)", nr, lr)
	}
	return fallback, "no rules in either backend; iptables --version default"
}

func hasHint(save []byte) bool {
	for _, c := range hintChains {
		if bytes.Contains(save, []byte("\n:"+c+" ")) || bytes.HasPrefix(save, []byte(":"+c+" ")) {
			return true
		}
	}
	return false
}

// countRules counts the rule lines of an iptables-save dump, and those of them that belong to
// Kubernetes (in or jumping to a KUBE-* chain).
func countRules(save []byte) (kube, all int) {
	for len(save) > 0 {
		line := save
		if i := bytes.IndexByte(save, '\n'); i >= 0 {
			line, save = save[:i], save[i+1:]
		} else {
			save = nil
		}
		if !bytes.HasPrefix(line, []byte("-A ")) {
			continue
		}
		all++
		if bytes.HasPrefix(line, []byte("-A KUBE-")) || bytes.Contains(line, []byte(" -j KUBE-")) {
			kube++
		}
	}
	return kube, all
}

{{/*
kvmapper.podTemplate is the replicas' pod template, as the chart writes it.
*/}}
{{- define "kvmapper.podTemplate" -}}
{{- $conn := dict "root" $ "auth" .Values.nats.auth -}}
metadata:
  labels:
    {{- include "kvmapper.selectorLabels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "kvmapper.serviceAccountName" . }}
  automountServiceAccountToken: false
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  # preStop pause + what the replica takes to hand its partitions over + a margin
  # (kvmapper.gracePeriod).
  terminationGracePeriodSeconds: {{ include "kvmapper.gracePeriod" . }}
  containers:
    - name: kvmapper
      image: {{ include "kvmapper.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      args:
        - run
        {{- range .Values.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      # Every setting is in the environment (kvmapper reads each flag from KVMAPPER_<FLAG>),
      # so that `kubectl exec … -- /kvmapper status` connects as the replica does.
      env:
        {{- with (include "kvmapper.natsEnv" $conn | trim) }}{{ . | nindent 8 }}{{ end }}
        # The pod's name is the replica's name among the replicas: unique, and stable
        # for the life of the pod.
        - name: KVMAPPER_REPLICA_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: KVMAPPER_METRICS_LISTEN
          value: {{ printf ":%d" (int .Values.metrics.port) | quote }}
        {{- with (include "kvmapper.goMemLimit" .) }}
        # Go collects sooner as the heap nears this, below the container's memory limit
        # (goMemLimitRatio of resources.limits.memory), instead of the container being killed.
        - name: GOMEMLIMIT
          value: {{ . | quote }}
        {{- end }}
        {{- with (include "kvmapper.env" .Values.config | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- with .Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: metrics
          containerPort: {{ .Values.metrics.port }}
          protocol: TCP
      # /healthz: 200 while the process runs. /readyz: 200 once connected to NATS with the
      # groups table loaded; 503 with the reason otherwise, and from SIGTERM on.
      livenessProbe:
        httpGet:
          path: /healthz
          port: metrics
        {{- toYaml .Values.probes.liveness | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /readyz
          port: metrics
        {{- toYaml .Values.probes.readiness | nindent 8 }}
      {{- if gt (int .Values.shutdown.preStopSeconds) 0 }}
      lifecycle:
        preStop:
          sleep:
            seconds: {{ .Values.shutdown.preStopSeconds }}
      {{- end }}
      resources:
        {{- toYaml .Values.resources | nindent 8 }}
      securityContext:
        {{- toYaml .Values.securityContext | nindent 8 }}
      {{- $mounts := include "kvmapper.natsMounts" $conn | trim }}
      {{- if or $mounts .Values.extraVolumeMounts }}
      volumeMounts:
        {{- with ($mounts | trim) }}{{ . | nindent 8 }}{{ end }}
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
  {{- $volumes := include "kvmapper.natsVolumes" $conn | trim }}
  {{- if or $volumes .Values.extraVolumes }}
  volumes:
    {{- with ($volumes | trim) }}{{ . | nindent 4 }}{{ end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- if or .Values.affinity (ne .Values.antiAffinity "none") }}
  affinity:
    {{- if .Values.affinity }}
    {{- toYaml .Values.affinity | nindent 4 }}
    {{- else if eq .Values.antiAffinity "hard" }}
    podAntiAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "kvmapper.selectorLabels" . | nindent 14 }}
    {{- else if eq .Values.antiAffinity "soft" }}
    podAntiAffinity:
      preferredDuringSchedulingIgnoredDuringExecution:
        - weight: 100
          podAffinityTerm:
            topologyKey: kubernetes.io/hostname
            labelSelector:
              matchLabels:
                {{- include "kvmapper.selectorLabels" . | nindent 16 }}
    {{- else }}
    {{- fail (printf "antiAffinity: %q; use soft, hard or none" .Values.antiAffinity) }}
    {{- end }}
  {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
kvmapper.podTemplateFinal is kvmapper.podTemplate with podTemplate.merge merged into it (maps
merged key by key, anything else replaced) and podTemplate.patch, a JSON Patch, applied after;
as written, comments and all, when neither is set.
*/}}
{{- define "kvmapper.podTemplateFinal" -}}
{{- $pod := include "kvmapper.podTemplate" . -}}
{{- with .Values.podTemplate -}}
{{- if or .merge .patch -}}
{{- $doc := $pod | fromYaml -}}
{{- if hasKey $doc "Error" -}}
{{- fail (printf "the pod template is not YAML: %s" (get $doc "Error")) -}}
{{- end -}}
{{- $doc = mergeOverwrite $doc (deepCopy (.merge | default dict)) -}}
{{- range $i, $op := .patch -}}
{{- $doc = (include "kvmapper.jsonPatch" (dict "doc" $doc "op" (deepCopy $op) "at" (printf "podTemplate.patch[%d]" $i)) | fromJson).doc -}}
{{- end -}}
{{- $pod = toYaml $doc -}}
{{- end -}}
{{- end -}}
{{- $pod -}}
{{- end -}}

{{/*
kvmapper.jsonPatch applies one operation of a JSON Patch (RFC 6902: add, remove or replace; a
path of /-separated tokens, ~1 for / and ~0 for ~ in a token, "-" for the end of a list) to
.doc, and prints {"doc": <the result>} as JSON. .at names the operation in errors.
*/}}
{{- define "kvmapper.jsonPatch" -}}
{{- $op := .op -}}
{{- if not (kindIs "map" $op) -}}
{{- fail (printf "%s: not an operation {op, path, value}" .at) -}}
{{- end -}}
{{- $kind := get $op "op" -}}
{{- if not (has $kind (list "add" "remove" "replace")) -}}
{{- fail (printf "%s: op %v; use add, remove or replace" .at $kind) -}}
{{- end -}}
{{- if and (ne $kind "remove") (not (hasKey $op "value")) -}}
{{- fail (printf "%s: %s needs a value" .at $kind) -}}
{{- end -}}
{{- $path := toString (get $op "path") -}}
{{- if not (hasPrefix "/" $path) -}}
{{- fail (printf "%s: path %q does not start with /" .at $path) -}}
{{- end -}}
{{- $tokens := list -}}
{{- range splitList "/" (trimPrefix "/" $path) -}}
{{- $tokens = append $tokens (replace "~0" "~" (replace "~1" "/" .)) -}}
{{- end -}}
{{- include "kvmapper.patchAt" (dict "doc" .doc "tokens" $tokens "op" $kind "value" (get $op "value") "at" (printf "%s (path %s)" .at $path)) -}}
{{- end -}}

{{/* kvmapper.patchAt applies .op at .tokens of .doc (see kvmapper.jsonPatch). */}}
{{- define "kvmapper.patchAt" -}}
{{- $doc := .doc -}}
{{- $tok := first .tokens -}}
{{- $rest := rest .tokens -}}
{{- if kindIs "map" $doc -}}
{{- $has := hasKey $doc $tok -}}
{{- if and (not $has) (or $rest (ne .op "add")) -}}
{{- fail (printf "%s: no %q" .at $tok) -}}
{{- end -}}
{{- if $rest -}}
{{- $_ := set $doc $tok (include "kvmapper.patchAt" (dict "doc" (get $doc $tok) "tokens" $rest "op" .op "value" .value "at" .at) | fromJson).doc -}}
{{- else if eq .op "remove" -}}
{{- $_ := unset $doc $tok -}}
{{- else -}}
{{- $_ := set $doc $tok .value -}}
{{- end -}}
{{- else if kindIs "slice" $doc -}}
{{- $n := len $doc -}}
{{- $i := $n -}}
{{- if ne $tok "-" -}}
{{- if not (regexMatch "^(0|[1-9][0-9]*)$" $tok) -}}
{{- fail (printf "%s: %q is no index of a list" .at $tok) -}}
{{- end -}}
{{- $i = atoi $tok -}}
{{- end -}}
{{- if or (gt $i $n) (and (eq $i $n) (or $rest (ne .op "add"))) -}}
{{- fail (printf "%s: index %s of a list of %d" .at $tok $n) -}}
{{- end -}}
{{- if $rest -}}
{{- $child := (include "kvmapper.patchAt" (dict "doc" (index $doc $i) "tokens" $rest "op" .op "value" .value "at" .at) | fromJson).doc -}}
{{- $doc = concat (slice $doc 0 $i) (list $child) (slice $doc (add1 $i)) -}}
{{- else if eq .op "add" -}}
{{- $doc = concat (slice $doc 0 $i) (list .value) (slice $doc $i) -}}
{{- else if eq .op "remove" -}}
{{- $doc = concat (slice $doc 0 $i) (slice $doc (add1 $i)) -}}
{{- else -}}
{{- $doc = concat (slice $doc 0 $i) (list .value) (slice $doc (add1 $i)) -}}
{{- end -}}
{{- else -}}
{{- fail (printf "%s: %q is inside a %s, not a map or a list" .at $tok (kindOf $doc)) -}}
{{- end -}}
{{- toJson (dict "doc" $doc) -}}
{{- end -}}
